"""``llmtap.relay.stepjson``: a large body parsed in steps reads exactly as ``json.loads`` reads it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from llmtap.relay import stepjson
from llmtap.relay.stepjson import loads_stepwise

VALID = [
    b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}',
    b' \n{ "a" : [ 1 , 2.5e3 , -0 , true , false , null , "x\\u00e9" , { } , [ ] ] , "a" : {"b":[[[[1]]]]} } \t',
    '\ufeff{"bom": "utf-8-sig"}'.encode(),
    '{"é":"ü","n":[{"deep":[{"deeper":[1,{"x":[]}]}]}]}'.encode(),
    "[1,2,3]".encode("utf-16"),
    b'"just a string"',
    b"12",
    b"[]",
    b"{}",
]
INVALID = [
    b"",
    b"   ",
    b"{",
    b'{"a":1,}',
    b"[1,2,]",
    b'{"a" 1}',
    b"{1:2}",
    b'{"a":1} x',
    b"[1 2]",
    b'{"a":[1,{"b":}]}',
    b'{"a":nul}',
    b"\xff\xfe\x00",
    b'{"a":"\xff"}',
    b"NaN-",
]


def run(body: bytes) -> Any:
    return asyncio.run(loads_stepwise(body))


@pytest.mark.parametrize("body", VALID)
def test_what_json_loads_reads_is_read_the_same(body: bytes) -> None:
    assert run(body) == json.loads(body)


@pytest.mark.parametrize("body", INVALID)
def test_what_json_loads_refuses_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(body)
    with pytest.raises(ValueError):
        run(body)


def test_a_large_body_gives_the_loop_turns_while_it_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stepjson, "STEP", 4096)
    messages = [{"role": "user", "content": f"message {i} " + "x" * 200} for i in range(2000)]
    body = json.dumps({"model": "m", "stream": True, "messages": messages}).encode()

    async def main() -> tuple[Any, int]:
        turns = 0
        done = False

        async def count() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        counter = asyncio.create_task(count())
        await asyncio.sleep(0)
        value = await loads_stepwise(body)
        done = True
        await counter
        return value, turns

    value, turns = asyncio.run(main())
    assert value == json.loads(body)
    # About one turn per 4 KiB parsed: the other task ran all along, not once at the end.
    assert turns >= len(body) // 4096 // 2, turns
