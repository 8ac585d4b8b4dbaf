"""``json.loads`` of a large request body in steps, letting the event loop turn between them (issue 28).

The relay reads a request body (up to ``max_inspect_bytes``) to ask a stream for usage, and ``json.loads``
of a body of megabytes holds the event loop for tens of milliseconds: every stream's next chunk waits. A
thread does not help (json's C scanner keeps the GIL for the whole call). So a large body is walked here:
the top levels of objects and arrays member by member, each member below ``DESCEND`` levels read whole by
json's own C scanner (``JSONDecoder.raw_decode``), and the loop gets a turn after every ``STEP`` characters.
A single member is read in one call: in a chat request that is one message, or one long string, which the C
scanner reads at about a gigabyte a second.

The result is what ``json.loads`` gives, and what it refuses is refused (``ValueError``, ``RecursionError``):
the same scanner reads every value, duplicate keys keep the last, and only whitespace may follow the value.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

__all__ = ["STEPWISE_BYTES", "loads_stepwise"]

#: Bodies larger than this are parsed here rather than by one ``json.loads`` (a few milliseconds' worth).
STEPWISE_BYTES = 1 << 20
#: Characters parsed between two turns of the event loop.
STEP = 256 << 10
#: Containers nested this deep or less are walked member by member; deeper ones are read whole.
DESCEND = 2

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


class _Walk:
    def __init__(self, text: str) -> None:
        self.text = text
        self.since = 0  # the position when the loop last had a turn

    def ws(self, i: int) -> int:
        match = _WS.match(self.text, i)
        return i if match is None else match.end()

    async def tick(self, i: int) -> None:
        if i - self.since >= STEP:
            self.since = i
            await asyncio.sleep(0)

    def fail(self, what: str, i: int) -> json.JSONDecodeError:
        return json.JSONDecodeError(what, self.text, i)

    async def value(self, i: int, depth: int) -> tuple[Any, int]:
        """The value at ``i`` (no whitespace before it) and the index just past it."""
        text = self.text
        opener = text[i : i + 1]
        if depth > DESCEND or opener not in ("{", "["):
            value, end = _DECODER.raw_decode(text, i)
            await self.tick(end)
            return value, end
        if opener == "{":
            return await self.members(i + 1, depth)
        return await self.elements(i + 1, depth)

    async def members(self, i: int, depth: int) -> tuple[dict[str, Any], int]:
        text = self.text
        out: dict[str, Any] = {}
        i = self.ws(i)
        if text[i : i + 1] == "}":
            return out, i + 1
        while True:
            if text[i : i + 1] != '"':
                raise self.fail("Expecting property name enclosed in double quotes", i)
            key, i = _DECODER.raw_decode(text, i)
            i = self.ws(i)
            if text[i : i + 1] != ":":
                raise self.fail("Expecting ':' delimiter", i)
            out[key], i = await self.value(self.ws(i + 1), depth + 1)
            i = self.ws(i)
            sep = text[i : i + 1]
            if sep == "}":
                return out, i + 1
            if sep != ",":
                raise self.fail("Expecting ',' delimiter", i)
            i = self.ws(i + 1)

    async def elements(self, i: int, depth: int) -> tuple[list[Any], int]:
        text = self.text
        out: list[Any] = []
        i = self.ws(i)
        if text[i : i + 1] == "]":
            return out, i + 1
        while True:
            item, i = await self.value(i, depth + 1)
            out.append(item)
            i = self.ws(i)
            sep = text[i : i + 1]
            if sep == "]":
                return out, i + 1
            if sep != ",":
                raise self.fail("Expecting ',' delimiter", i)
            i = self.ws(i + 1)


async def loads_stepwise(body: bytes) -> Any:
    """``json.loads(body)``, with a turn of the event loop after every ``STEP`` characters."""
    text = body.decode(json.detect_encoding(body), "surrogatepass")
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    walk = _Walk(text)
    start = walk.ws(0)
    if start == len(text):
        raise walk.fail("Expecting value", start)
    value, end = await walk.value(start, 1)
    end = walk.ws(end)
    if end != len(text):
        raise walk.fail("Extra data", end)
    return value
