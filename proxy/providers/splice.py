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
"""

from __future__ import annotations

import json
import re
from typing import Any

from proxy.types import UNCHANGED, Prepared

_BOM = b"\xef\xbb\xbf"
_JSON_WS = b" \t\n\r"
# A JSON string (the unrolled ``"(?:[^"\\]|\\.)*"``, linear in C), and whether a colon follows it,
# which makes it a key; or one bracket. Numbers, literals, commas and whitespace are skipped by
# ``finditer`` itself, so the Python loop below runs once per string or bracket, never per byte.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"([ \t\n\r]*:)?|[{}\[\]]', re.DOTALL)
_KEY = b'"stream_options"'
_OBJECT_VALUE = re.compile(rb"[ \t\n\r]*\{")
_OPEN = frozenset(b"{[")


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
    found = _last_top_level_object(body, _KEY)
    if found is None:  # unreachable for a body json.loads read; forwarding unchanged is the safe answer
        return UNCHANGED
    start, end = found
    members = [b'"include_usage":true']
    # vLLM only honours continuous_usage_stats together with include_usage (standards B.3); the client saw
    # no per-chunk usage before, so turning usage on must not turn that on behind its back.
    if options.get("continuous_usage_stats"):
        members.append(b'"continuous_usage_stats":false')
    empty = not body[start + 1 : end].strip(_JSON_WS)
    return _insert(body, end, (b"" if empty else b",") + b",".join(members))


def _insert(body: bytes, at: int, inserted: bytes) -> Prepared:
    return Prepared(body[:at] + inserted + body[at:], True)


def _last_top_level_object(body: bytes, key: bytes) -> tuple[int, int] | None:
    """Offsets of ``{`` and ``}`` of the object value of the last top-level member named ``key``.

    ``body`` must be valid JSON (one object). Depth counts both brackets: a key at depth 1 is a member of
    the top-level object, while one in a nested object or array is deeper and left alone.
    """
    depth = 0
    capture = False  # the next ``{`` at depth 1 opens the value of a matching key
    start = -1
    found: tuple[int, int] | None = None
    for match in _TOKEN.finditer(body):
        first = body[match.start()]
        if first == 0x22:  # '"'
            if depth == 1 and match.group(1) is not None:
                token = body[match.start() : match.end() - len(match.group(1))]
                capture = _is_key(token, key) and _OBJECT_VALUE.match(body, match.end()) is not None
        elif first in _OPEN:
            depth += 1
            if capture and depth == 2:
                start, capture = match.start(), False
        else:
            depth -= 1
            if depth == 1 and start >= 0:
                found, start = (start, match.start()), -1
    return found


def _is_key(token: bytes, key: bytes) -> bool:
    """True when the JSON string ``token`` spells ``key``, escapes decoded (``"stream\\u005foptions"``)."""
    if token == key:
        return True
    if b"\\" not in token:
        return False
    try:
        return bool(json.loads(token) == json.loads(key))
    except ValueError:
        return False
