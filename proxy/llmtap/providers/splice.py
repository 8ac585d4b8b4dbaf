"""Ask an OpenAI stream for usage by splicing bytes into the client's request, never by re-serializing it.

A streamed Chat Completions or Completions response carries no usage unless the request says
``stream_options.include_usage: true`` (standards D.1, D.2). llmtap adds that option when the client
did not, and the relay removes the extra usage event again (``UsageEventFilter``).

Why splice instead of ``json.loads`` then ``json.dumps``: the upstream must receive the request the
client wrote. Re-serializing changes it in ways a server can notice: key order and duplicate keys
(``json.loads`` keeps the last one and drops the rest), number spellings (``1.0e3`` becomes ``1000.0``,
``1e999`` becomes ``Infinity``, which is not JSON), string escapes, a UTF-8 BOM and the whitespace, and
it costs a full serialization on the relay's hot path. Splicing keeps every byte the client sent, in
order, and only inserts the option: removing the inserted bytes gives the client's body back exactly.

Duplicate keys follow ``json.loads`` (and most servers): the last occurrence wins. So the option is
inserted at the end of the last top-level ``stream_options`` object, where it wins over a client's
``include_usage: false`` inside it, or as a new last member of the body when there is none.

Finding where: the body is validated by one ``json.loads`` first. With no top-level ``stream_options``
the place is the final closing brace, found by stripping trailing whitespace: no scan at all. Otherwise
the top-level members are walked one by one, each key and value read whole by json's own C scanner
(``JSONDecoder.raw_decode``), so the Python loop runs once per top-level member. A regex tokenizer
tracking bracket depth was tried first and dropped: Python's ``re`` spends 1-6 ns per byte inside long
strings (about 95 µs for a 25 KB chat request, more than ``json.loads`` plus ``json.dumps``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmtap.types import UNCHANGED, Prepared

__all__ = ["prepare_usage", "splice_usage"]

_BOM = b"\xef\xbb\xbf"
_JSON_WS = b" \t\n\r"
_WS = re.compile(r"[ \t\n\r]*")
_COLON = re.compile(r"[ \t\n\r]*:[ \t\n\r]*")
_COMMA = re.compile(r"[ \t\n\r]*(?:,[ \t\n\r]*)?")
# Reads one JSON value from a position and says where it ended: json's C scanner, as json.loads uses.
_DECODER = json.JSONDecoder()


def prepare_usage(body: bytes, *, inject_usage: bool) -> Prepared:
    """The request body with ``include_usage: true`` spliced in when llmtap should ask for usage.

    Changes only a JSON object (UTF-8, with or without a BOM) whose top-level ``stream`` is exactly
    ``true`` and whose effective ``stream_options.include_usage`` is not ``true``; anything else
    (invalid or truncated JSON, another type, no stream, ``stream_options`` null or not an object) gives
    ``Prepared(None, False)``: the body is forwarded unchanged. Never raises.
    """
    if not inject_usage:
        return UNCHANGED
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # invalid JSON or UTF-8, too many digits, too deep
        return UNCHANGED
    return splice_usage(body, obj)


def splice_usage(body: bytes, obj: Any) -> Prepared:
    """``prepare_usage`` for a body already parsed by ``json.loads(body)`` into ``obj``."""
    if not isinstance(obj, dict) or obj.get("stream") is not True:
        return UNCHANGED
    # json.loads also reads UTF-16 and UTF-32; bytes spliced into those would corrupt them.
    if json.detect_encoding(body) not in ("utf-8", "utf-8-sig"):
        return UNCHANGED
    if "stream_options" not in obj:
        # The body ends with its closing brace, then JSON whitespace; ``stream`` is a member, so a comma.
        end = len(body.rstrip(_JSON_WS)) - 1
        return _insert(body, end, b',"stream_options":{"include_usage":true}')
    options = obj["stream_options"]
    if not isinstance(options, dict) or options.get("include_usage") is True:
        # Null or not an object: the server's reading of it is unknown, so do not guess. Asked: nothing to do.
        return UNCHANGED
    try:
        found = _last_member(body, "stream_options")
    except (ValueError, IndexError, RecursionError):  # unreachable for a body json.loads read
        found = None
    if found is None:  # forwarding unchanged is the safe answer
        return UNCHANGED
    end, empty = found
    members = [b'"include_usage":true']
    # vLLM only honours continuous_usage_stats together with include_usage (standards B.3); the client saw
    # no per-chunk usage before, so turning usage on must not turn that on behind its back.
    if options.get("continuous_usage_stats"):
        members.append(b'"continuous_usage_stats":false')
    return _insert(body, end, (b"" if empty else b",") + b",".join(members))


def _insert(body: bytes, at: int, inserted: bytes) -> Prepared:
    return Prepared(body[:at] + inserted + body[at:], True)


def _last_member(body: bytes, name: str) -> tuple[int, bool] | None:
    """The byte offset of the closing brace of the last top-level member ``name`` when its value is an
    object, and whether that object is empty; None when there is no such member.

    ``body`` must be a JSON object json.loads read. The loop runs once per top-level member: each key and
    value is read whole by json's C scanner (``raw_decode``), so nested objects, arrays and strings, a
    ``stream_options`` key inside them included, are skipped in C and never mistaken for top-level ones,
    and an escaped key (``"stream\\u005foptions"``) is compared decoded.
    """
    bom = len(_BOM) if body.startswith(_BOM) else 0
    text = body[bom:].decode("utf-8", "surrogatepass")  # as json.loads decodes it: offsets agree
    i = _after(_WS, text, 0) + 1  # past "{"
    found: tuple[int, bool] | None = None
    i = _after(_WS, text, i)
    while text[i] != "}":
        key, i = _DECODER.raw_decode(text, i)
        value, i = _DECODER.raw_decode(text, _after(_COLON, text, i))
        if key == name:
            found = (i - 1, not value) if isinstance(value, dict) else None
        i = _after(_COMMA, text, i)
    if found is None or body.isascii():
        return found
    end, empty = found
    return bom + len(text[:end].encode("utf-8", "surrogatepass")), empty


def _after(pattern: re.Pattern[str], text: str, i: int) -> int:
    """The index just past what ``pattern`` matches at ``i``; ``i`` when it does not match."""
    match = pattern.match(text, i)
    return i if match is None else match.end()
