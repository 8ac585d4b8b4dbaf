"""Incremental decoders for streamed LLM response bodies: SSE, NDJSON and streamed JSON arrays.

Pure objects in the shape of httpx's ``_decoders.py``: ``feed(bytes) -> list[Event]`` for every network
chunk and ``flush() -> list[Event]`` at the end of the body. No I/O, no OpenTelemetry, and no JSON parsing
beyond the lexical scan ``JSONArrayDecoder`` needs to find element boundaries. Each decoder bounds its
memory: an event, line or element larger than the limit is dropped and counted in ``oversized``, and
decoding carries on with the next one. Invalid UTF-8 is replaced with U+FFFD, never raised.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "DEFAULT_MAX_BYTES",
    "Decoder",
    "Event",
    "JSONArrayDecoder",
    "NDJSONDecoder",
    "SSEDecoder",
    "decoder_for",
]

DEFAULT_MAX_BYTES = 16 * 1024 * 1024

_BOM = b"\xef\xbb\xbf"


@dataclass(slots=True, frozen=True)
class Event:
    """One dispatched event: the ``event:`` name ('' when absent) and the joined ``data:`` lines."""

    event: str
    data: str
    id: str | None = None


class Decoder(Protocol):
    """What the relay needs from a decoder: chunks in, events out, and the count of dropped events."""

    oversized: int

    def feed(self, chunk: bytes) -> list[Event]: ...

    def flush(self) -> list[Event]: ...


def _end_cut_line(lines: list[bytes], held: bytearray, dropped: bool) -> bool:
    """End a line the chunking cut with ``lines[0]``, the chunk's first LF-ended line; whether one is still dropped.

    Both decoders end it alike: the part ``held`` from earlier chunks (emptied here) is joined to the first line;
    a line not kept at all (``dropped``: too long, or in a dropped event) has its end dropped too, rather than
    read as a line of its own. Called only when a line was cut, so a chunk of whole lines pays no call.
    """
    if held:
        held += lines[0]
        lines[0] = bytes(held)
        held.clear()
        return dropped
    del lines[0]
    return False


class SSEDecoder:
    """Incremental ``text/event-stream`` parser following the WHATWG event stream interpretation rules.

    https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation
    ``Event.id`` is the last event ID at dispatch time: per the spec it persists across events until an
    ``id:`` field changes it, and is None until the stream sets one.
    """

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._max = max_event_bytes
        self.oversized = 0
        self._reset()

    def _reset(self) -> None:
        self._line = bytearray()  # the current line, not yet terminated
        self._line_dropped = False  # the current line belongs to a dropped event and was not kept
        self._data: list[bytes] = []  # the data buffer, one entry per `data:` line
        self._event = b""  # the event type buffer
        self._id: str | None = None  # the last event ID buffer
        self._size = 0  # bytes held for the pending event
        self._discarding = False  # skipping the rest of an oversized event, up to its blank line
        self._skip_lf = False  # the last chunk ended in CR: an LF that starts the next one ends no line
        self._started = False  # the leading BOM check is done
        #: Between two events, nothing held: the BOM check done, no line, data, event or discarding pending.
        self._between = False

    def feed(self, chunk: bytes) -> list[Event]:
        """Decode one chunk of the body; return the events whose blank line it completed."""
        if (
            self._between
            and chunk[:6] == b"data: "
            and chunk[-2:] == b"\n\n"
            and len(chunk) <= self._max
            and b"\r" not in chunk
        ):
            # The common read: whole events of one ``data:`` line each, between events before it. What the
            # general path makes of it, without walking it line by line.
            end = len(chunk) - 2
            if chunk.find(b"\n", 6) == end:  # one event
                return [Event("", chunk[6:end].decode("utf-8", "replace"), self._id)]
            parts = chunk[:end].split(b"\n\n")
            if all(part[:6] == b"data: " and b"\n" not in part for part in parts):
                last_id = self._id
                return [Event("", part[6:].decode("utf-8", "replace"), last_id) for part in parts]
        if not self._started:
            # "One leading U+FEFF BYTE ORDER MARK character must be ignored if any are present."
            # Hold back a start that may still be a BOM cut by the chunking.
            head = bytes(self._line) + chunk
            if len(head) < len(_BOM) and _BOM.startswith(head):
                self._line[:] = head
                return []
            self._line.clear()
            self._started = True
            chunk = head[len(_BOM) :] if head.startswith(_BOM) else head
        if self._skip_lf and chunk:
            # The spec's line ends are CRLF, LF or CR; a CRLF cut between two chunks is still one.
            self._skip_lf = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]
        if b"\r" in chunk:
            self._skip_lf = chunk[-1] == 0x0D
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = chunk.split(b"\n")
        tail = lines.pop()
        events: list[Event] = []
        if lines:
            if self._line or self._line_dropped:
                # The end of a line of a dropped event is not blank, so it cannot end the discarding either.
                self._line_dropped = _end_cut_line(lines, self._line, self._line_dropped)
            for line in lines:
                self._process(line, events)
        if tail:
            if self._discarding:
                self._line_dropped = True
            else:
                self._line += tail
                if self._size + len(self._line) > self._max:
                    self._drop()
                    self._line_dropped = True
        self._between = not (
            self._line or self._line_dropped or self._data or self._event or self._discarding or self._skip_lf
        )
        return events

    def flush(self) -> list[Event]:
        """End of body: the spec discards an event not yet ended by a blank line, so this returns []."""
        # "If the file ends in the middle of an event, before the final empty line, the incomplete event
        # is not dispatched." Reset so that nothing of this stream leaks into a reuse of the decoder.
        self._reset()
        return []

    def _process(self, line: bytes, events: list[Event]) -> None:
        if not line:
            # A blank line dispatches, unless the data buffer is empty (no `data` field at all).
            if self._discarding:
                self._discarding = False
            elif self._data:
                data = b"\n".join(self._data).decode("utf-8", "replace")
                events.append(Event(self._event.decode("utf-8", "replace"), data, self._id))
            self._data = []
            self._event = b""
            self._size = 0
            return
        if self._discarding:
            return
        if self._size + len(line) > self._max:
            self._drop()
            return
        colon = line.find(b":")
        if colon == 0:  # a comment
            return
        if colon < 0:  # a field name alone: its value is the empty string
            name, value = line, b""
        else:
            name, value = line[:colon], line[colon + 1 :]
            if value[:1] == b" ":  # one space after the colon is not part of the value
                value = value[1:]
        if name == b"data":
            self._data.append(value)
            self._size += len(line)
        elif name == b"event":
            self._event = value
            self._size += len(line)
        elif name == b"id":
            if b"\0" not in value:
                self._id = value.decode("utf-8", "replace")
        # `retry` and unknown fields are ignored: the proxy never reconnects.

    def _drop(self) -> None:
        self.oversized += 1
        self._data = []
        self._event = b""
        self._size = 0
        self._line.clear()
        self._discarding = True


class NDJSONDecoder:
    """Newline-delimited JSON (Ollama): one ``Event(event="", data=line)`` per non-blank line."""

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._max = max_line_bytes
        self.oversized = 0
        self._line = bytearray()
        self._dropped = False  # the current line is oversized; skip to its LF

    def feed(self, chunk: bytes) -> list[Event]:
        """Decode one chunk of the body; return one event per line it completed."""
        lines = chunk.split(b"\n")
        tail = lines.pop()
        events: list[Event] = []
        if lines:
            if self._line or self._dropped:
                self._dropped = _end_cut_line(lines, self._line, self._dropped)
            for line in lines:
                # The size includes a trailing CR so that it does not depend on where the chunks split.
                if len(line) > self._max:
                    self.oversized += 1
                else:
                    _append_line(line, events)
        if tail and not self._dropped:
            self._line += tail
            if len(self._line) > self._max:
                self.oversized += 1
                self._line.clear()
                self._dropped = True
        return events

    def flush(self) -> list[Event]:
        """End of body: the last line even without its newline (lenient), then a reset."""
        events: list[Event] = []
        if self._line:
            _append_line(bytes(self._line), events)
        self._line.clear()
        self._dropped = False
        return events


def _append_line(line: bytes, events: list[Event]) -> None:
    if line.endswith(b"\r"):
        line = line[:-1]
    # A blank line carries no JSON value; skipping it is the lenient reading of NDJSON.
    if line.strip():
        events.append(Event("", line.decode("utf-8", "replace")))


# Outside strings only brackets and quotes matter; inside, only the closing quote and backslash escapes.
_STRUCTURAL = re.compile(rb'[\[\]{}"]')
_IN_STRING = re.compile(rb'["\\]')


class JSONArrayDecoder:
    """A JSON array streamed element by element (Gemini ``streamGenerateContent`` without ``alt=sse``).

    Yields each top-level object or array element as soon as its closing bracket arrives, its JSON text
    unparsed. A body that is a single object (an error) yields that object. Scalar elements are ignored.
    """

    def __init__(self, max_element_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._max = max_element_bytes
        self.oversized = 0
        self._reset()

    def _reset(self) -> None:
        self._buf = bytearray()  # the current element's bytes from earlier chunks
        self._depth = 0  # open brackets around the scan position
        self._in_elem = False
        self._elem_depth = 0  # depth outside the current element: 1 in the array, 0 for a lone object
        self._dropping = False  # the current element is oversized; scan it without keeping it
        self._in_string = False
        self._escape = False  # a backslash ended the last chunk: the next byte is escaped

    def feed(self, chunk: bytes) -> list[Event]:
        """Decode one chunk of the body; return the elements it completed."""
        events: list[Event] = []
        n = len(chunk)
        pos = 0
        start = 0  # where the current element begins in this chunk
        if self._escape and n:
            self._escape = False
            pos = 1
        depth = self._depth
        while pos < n:
            if self._in_string:
                m = _IN_STRING.search(chunk, pos)
                if m is None:
                    break
                pos = m.end()
                if chunk[pos - 1] == 0x5C:  # backslash: skip the escaped byte (RFC 8259, section 7)
                    if pos == n:
                        self._escape = True
                        break
                    pos += 1
                else:
                    self._in_string = False
                continue
            m = _STRUCTURAL.search(chunk, pos)
            if m is None:
                break
            pos = m.end()
            c = chunk[pos - 1]
            if c == 0x22:  # "
                self._in_string = True
            elif c == 0x7B or c == 0x5B:  # { [
                # An element opens inside the top-level array (depth 1), or is a lone top-level object.
                if not self._in_elem and (depth or c == 0x7B):
                    self._in_elem = True
                    self._elem_depth = depth
                    start = pos - 1
                depth += 1
            else:  # } ]
                if depth:
                    depth -= 1
                if self._in_elem and depth == self._elem_depth:
                    self._in_elem = False
                    self._end_element(chunk, start, pos, events)
        self._depth = depth
        if self._in_elem and not self._dropping:
            self._buf += memoryview(chunk)[start:]
            if len(self._buf) > self._max:
                self.oversized += 1
                self._buf.clear()
                self._dropping = True
        return events

    def flush(self) -> list[Event]:
        """End of body: an unclosed element is not valid JSON and is discarded; then a reset."""
        self._reset()
        return []

    def _end_element(self, chunk: bytes, start: int, end: int, events: list[Event]) -> None:
        if self._dropping:  # already counted when it outgrew the limit
            self._dropping = False
        elif len(self._buf) + end - start > self._max:
            self.oversized += 1
        else:
            data = bytes(self._buf) + chunk[start:end] if self._buf else chunk[start:end]
            events.append(Event("", data.decode("utf-8", "replace")))
        self._buf.clear()


def decoder_for(framing: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Decoder:
    """A fresh decoder for a body framed as "sse", "ndjson" or "json-array"."""
    if framing == "sse":
        return SSEDecoder(max_bytes)
    if framing == "ndjson":
        return NDJSONDecoder(max_bytes)
    if framing == "json-array":
        return JSONArrayDecoder(max_bytes)
    raise ValueError(f"unknown framing: {framing!r}")
