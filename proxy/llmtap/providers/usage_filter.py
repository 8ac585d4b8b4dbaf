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
"""

from __future__ import annotations

import json
import re

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
_CR_LF = (b"\r", b"\n")
# A boundary is at most four bytes long, so one that completes inside a new chunk starts at most three
# bytes before the chunk in the held buffer.
_BOUNDARY_REACH = 3


def _is_usage_event(block: bytes) -> bool:
    """True when ``block`` is exactly one plain ``data:`` event whose JSON is the extra usage chunk."""
    data: list[bytes] = []
    for line in _LINE_END.split(block):
        if not line:
            continue
        if not line.startswith(b"data:"):
            return False  # event:, id:, retry: or a comment: not the plain usage chunk, so keep it
        value = line[5:]
        data.append(value[1:] if value.startswith(b" ") else value)
    if not data:
        return False
    try:
        obj = json.loads(b"\n".join(data))
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and obj.get("choices") == [] and obj.get("usage") is not None


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
    """Passes an SSE byte stream through, minus the usage event(s) the client did not ask for."""

    def __init__(self, max_held: int = MAX_HELD_BYTES) -> None:
        self._held = bytearray()
        self._max_held = max_held
        self._passthrough = False
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
        if not held and chunk[-3:-2] not in _CR_LF and chunk.endswith(b"\n\n") and not _EMPTY_CHOICES.search(chunk):
            # The common case, whole events with nothing held and no usage event among them: the last boundary is
            # the chunk's own end (a run of exactly two LFs), so all of it goes, as the general path would send it.
            return chunk
        start = max(0, len(held) - _BOUNDARY_REACH)
        held += chunk
        cut = _last_boundary_end(held, start)
        if cut < 0:
            return self._give_up() if len(held) > self._max_held else b""
        complete = bytes(held[:cut])
        del held[:cut]
        out = self._drop_usage(complete)
        if len(held) > self._max_held:
            return out + self._give_up()
        return out

    def flush(self) -> bytes:
        """The held tail at stream end, unchanged: an event without its blank line is never dispatched."""
        rest = bytes(self._held)
        self._held.clear()
        return rest

    def _give_up(self) -> bytes:
        self._passthrough = True
        return self.flush()

    def _drop_usage(self, complete: bytes) -> bytes:
        # ``complete`` starts and ends on event boundaries, so its events are the blocks between matches.
        if not _EMPTY_CHOICES.search(complete):
            return complete
        kept: list[bytes] = []
        pos = 0
        for match in _BOUNDARY.finditer(complete):
            block = complete[pos : match.start()]
            if _EMPTY_CHOICES.search(block) and _is_usage_event(block):
                self.removed += 1
            else:
                kept.append(complete[pos : match.end()])
            pos = match.end()
        return b"".join(kept)
