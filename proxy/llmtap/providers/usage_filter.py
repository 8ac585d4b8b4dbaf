"""Removes the usage event the proxy asked for from an OpenAI stream; every other byte passes unchanged.

When a client streams Chat Completions or Completions without ``stream_options.include_usage``, the
proxy asks for usage anyway (DESIGN "Tokens"); the server then sends one extra ``data:`` event whose JSON
has ``"choices": []`` and a non-null ``usage`` before ``data: [DONE]`` (standards D.1, D.2). That client
never asked for it, and SDKs that index ``choices[0]`` break on it, so it is cut out here.

Why holding a partial event adds no delay a client can see: an SSE client dispatches an event only when
it reads the blank line that ends it (WHATWG HTML, "Interpreting an event stream": an empty line
dispatches; a stream that ends mid-event dispatches nothing). Bytes up to the last complete event boundary
leave immediately, and the held bytes go out in the same ``feed`` call that brings their blank line, so
every event reaches the client at the moment it would have without the filter.

Asking for usage changes more than that one event, and the filter undoes each change it can, so the client
receives what it would have received had llmtap not asked (README "What the client receives"):
  * OpenAI adds ``"usage":null`` to every other chunk once asked ("All other chunks will also include a
    ``usage`` field, but with a null value", standards D.1): that top-level member is cut out of each chunk
    (``strip_null_usage``), with one of its commas, so the rest of the chunk is byte for byte as sent.
  * vLLM stamps ``system_fingerprint`` on a chat stream's terminal chunks (those with a ``finish_reason``)
    only when usage was not asked for; asked, it moves the field to the usage chunk. So a run of terminal
    chat chunks without the field is held until the next event; when that is the usage chunk, its
    fingerprint is put back as each held chunk's last member (``graft_fingerprint``), where vLLM writes it.
    The wait is for bytes vLLM writes back to back (the usage chunk follows the last terminal chunk in the
    same generator step), so nothing arrives later than it would have; with ``n`` > 1, a choice that ends
    before another is released by the other's next chunk, unstamped (the fingerprint is not known yet).
``--no-inject-usage`` leaves the request, and so every byte of the answer, exactly as the upstream wrote it.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["MAX_HELD_BYTES", "UsageEventFilter"]

#: A held partial event larger than this makes the filter give up and pass everything through.
MAX_HELD_BYTES = 1 << 20

# A blank line ends an event: two line terminators in a row (LF, CRLF or CR line endings). Mixed forms
# such as LF followed by CRLF are left unrecognised: the events around them stay joined in one block,
# which then never looks like a lone usage event and passes through. Failing safe costs one usage chunk.
_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_END = re.compile(rb"\r\n|\r|\n")
# The cheap test that picks candidates; only a block that passes it is parsed as JSON. Servers write the
# empty array compactly (OpenAI, vLLM) or with spaces, and text content cannot match it unescaped.
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
# Any block the filter may act on: a usage chunk, a chunk with a null usage, a terminal chunk. Inside a JSON
# string every quote is escaped, so none of these can match text content.
_CANDIDATE = re.compile(rb'"choices"\s*:\s*\[\s*\]|"usage"\s*:\s*null|"finish_reason"\s*:\s*"')
_USAGE_KEY = b'"usage"'
_NULL_MEMBER = re.compile(rb'"usage"[ \t\r\n]*:[ \t\r\n]*null')
# What may follow a top-level null usage up to the end of its one-line event: OpenAI's obfuscation, the object's end.
_LAST_MEMBER = re.compile(rb'[ \t]*(?:,[ \t]*"obfuscation"[ \t]*:[ \t]*"[^"\\\r\n]*"[ \t]*)?\}[ \t]*(?:\r\n|\r|\n)+')
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')
_FINGERPRINT = b'"system_fingerprint"'
_CHAT_CHUNK = "chat.completion.chunk"
_CR_LF = (b"\r", b"\n")
# A boundary is at most four bytes long, so one that completes inside a new chunk starts at most three
# bytes before the chunk in the held buffer.
_BOUNDARY_REACH = 3


def _event_json(block: bytes) -> dict[str, Any] | None:
    """The JSON object of ``block`` when it is exactly one plain ``data:`` event holding one; else None."""
    data: list[bytes] = []
    for line in _LINE_END.split(block):
        if not line:
            continue
        if not line.startswith(b"data:"):
            return None  # event:, id:, retry: or a comment: not a plain chunk, so leave it as it is
        value = line[5:]
        data.append(value[1:] if value.startswith(b" ") else value)
    if not data:
        return None
    try:
        obj = json.loads(b"\n".join(data))
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _is_usage_event(block: bytes) -> bool:
    """True when ``block`` is exactly one plain ``data:`` event whose JSON is the extra usage chunk."""
    obj = _event_json(block)
    return obj is not None and obj.get("choices") == [] and obj.get("usage") is not None


def strip_null_usage(block: bytes) -> bytes:
    """``block`` without its chunk's top-level ``"usage": null`` member and the comma before it, else unchanged.

    Cut only where it is certain, without parsing (this runs on every OpenAI chunk): the block is one ``data:``
    line with choices, ``"usage"`` occurs in it once (a key cannot hide inside a string: its quotes would be
    escaped), a comma comes before it, and after ``null`` only the object's end follows (OpenAI's ``obfuscation``
    member at most), so it is the top-level object's member.
    """
    at = block.find(_USAGE_KEY)
    if at < 0 or block.find(_USAGE_KEY, at + len(_USAGE_KEY)) >= 0 or not block.startswith(b"data:"):
        return block
    member = _NULL_MEMBER.match(block, at)
    if member is None or _LAST_MEMBER.fullmatch(block, member.end()) is None or _EMPTY_CHOICES.search(block):
        return block  # not the null usage member, or a chunk without choices (not one OpenAI writes)
    comma = len(block[:at].rstrip(b" \t\r\n")) - 1
    if comma < 0 or block[comma : comma + 1] != b",":
        return block
    return block[:comma] + block[member.end() :]


def is_unstamped_terminal(block: bytes) -> bool:
    """True for a chat chunk with a ``finish_reason`` and no ``system_fingerprint``: one vLLM would have stamped."""
    if _FINGERPRINT in block or not _FINISHED.search(block):
        return False
    obj = _event_json(block)
    return obj is not None and obj.get("object") == _CHAT_CHUNK and "system_fingerprint" not in obj


def graft_fingerprint(block: bytes, fingerprint: str) -> bytes:
    """``block`` (one ``data:`` line and its blank line) with ``system_fingerprint`` as its chunk's last member."""
    close = block.rfind(b"}")
    member = b',"system_fingerprint":' + json.dumps(fingerprint, ensure_ascii=False).encode()
    return block[:close] + member + block[close:]


def _fingerprint_of(block: bytes) -> str | None:
    """The usage chunk's ``system_fingerprint`` when it is a string."""
    obj = _event_json(block)
    value = obj.get("system_fingerprint") if obj is not None else None
    return value if isinstance(value, str) else None


def _last_boundary_end(buf: bytearray, start: int) -> int:
    """Where the last ``_BOUNDARY`` match from ``start`` ends, as ``finditer`` finds it; -1 when there is none.

    The regex costs about 14 ns a byte; ``rfind`` next to nothing. So the last place a terminator pair occurs
    is found with ``rfind``, and the regex runs only over the run of CR and LF bytes around it: a match holds
    nothing else, so how the matches fall inside a run depends only on where the run begins, and the run
    holding the last pair holds the last match.
    """
    last = max(buf.rfind(b"\n\n", start), buf.rfind(b"\r\r", start), buf.rfind(b"\r\n\r\n", start))
    if last < 0:
        return -1
    begin = max(start, len(buf[:last].rstrip(b"\r\n")))
    tail = buf[last:]
    end = last + len(tail) - len(tail.lstrip(b"\r\n"))
    cut = -1
    for match in _BOUNDARY.finditer(buf, begin, end):
        cut = match.end()
    return cut


class UsageEventFilter:
    """Passes an SSE byte stream through, minus the usage event(s) the client did not ask for and the changes
    asking made to the other events."""

    def __init__(self, max_held: int = MAX_HELD_BYTES) -> None:
        self._held = bytearray()
        self._max_held = max_held
        self._passthrough = False
        #: Complete terminal chat chunks waiting for the next event, which may bring their fingerprint.
        self._terminal: list[bytes] = []
        #: How many events were removed; 1 for a well-behaved server.
        self.removed = 0

    @property
    def gave_up(self) -> bool:
        """True once an oversized partial event switched the filter to plain pass-through."""
        return self._passthrough

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send now: everything up to the last complete event, minus usage events; may be empty."""
        if self._passthrough:
            return chunk
        held = self._held
        if not held and not self._terminal and chunk[-3:-2] not in _CR_LF and chunk.endswith(b"\n\n"):
            # The common case, whole events with nothing held: the last boundary is the chunk's own end (a run of
            # exactly two LFs), so all of it goes, as the general path would send it; with nothing to act on, as is.
            found = _CANDIDATE.search(chunk)
            if found is None:
                return chunk
            if found[0].startswith(_USAGE_KEY) and chunk.find(b"\n\n") == len(chunk) - 2:
                # One OpenAI chunk with its "usage": null, and nothing else to act on (a null usage comes after the
                # choices, so a usage chunk or a finish_reason would have matched first).
                return strip_null_usage(chunk)
        start = max(0, len(held) - _BOUNDARY_REACH)
        held += chunk
        cut = _last_boundary_end(held, start)
        if cut < 0:
            return self._give_up() if len(held) > self._max_held else b""
        complete = bytes(held[:cut])
        del held[:cut]
        out = self._rewrite(complete)
        if len(held) > self._max_held:
            return out + self._give_up()
        return out

    def flush(self) -> bytes:
        """Held terminal chunks and the held tail at stream end, unchanged: an event without its blank line is never
        dispatched."""
        rest = b"".join(self._terminal) + bytes(self._held)
        self._terminal.clear()
        self._held.clear()
        return rest

    def _give_up(self) -> bytes:
        self._passthrough = True
        return self.flush()

    def _rewrite(self, complete: bytes) -> bytes:
        # ``complete`` starts and ends on event boundaries, so its events are the blocks between matches.
        if not self._terminal and not _CANDIDATE.search(complete):
            return complete
        out: list[bytes] = []
        pos = 0
        for match in _BOUNDARY.finditer(complete):
            self._event(complete[pos : match.start()], complete[pos : match.end()], out)
            pos = match.end()
        return b"".join(out)

    def _event(self, block: bytes, event: bytes, out: list[bytes]) -> None:
        """Act on one complete event (``block`` without its blank line, ``event`` with it): drop, rewrite, hold."""
        if _EMPTY_CHOICES.search(block) and _is_usage_event(block):
            self.removed += 1
            fingerprint = _fingerprint_of(block)
            held, self._terminal = self._terminal, []
            out.extend(held if fingerprint is None else (graft_fingerprint(e, fingerprint) for e in held))
            return
        if not _CANDIDATE.search(block):
            out.extend(self._terminal)
            self._terminal.clear()
            out.append(event)
            return
        event = strip_null_usage(event)
        if is_unstamped_terminal(block) and sum(map(len, self._terminal)) + len(event) <= self._max_held:
            self._terminal.append(event)
            return
        out.extend(self._terminal)
        self._terminal.clear()
        out.append(event)
