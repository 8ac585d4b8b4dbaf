"""Frames on the relay's socket to a telemetry process: a 4-byte big-endian length, then the ``marshal`` form.

``marshal`` (not ``pickle``) because it reads and writes plain tuples of bytes, strings and numbers at C speed
and cannot build arbitrary objects; the socket is private to one server's processes, which are always the
same build (``llmtap.wire.messages`` checks field counts all the same). A length past ``MAX_FRAME`` or a body
``marshal`` cannot read means the byte stream lost its framing: nothing after it can be trusted, so the reader
stops (``FrameReader.broken``) and its owner drops the connection; the relay connects again.
"""

from __future__ import annotations

import marshal
import struct

from llmtap.wire.messages import Raw, WireError, body_beside, lift_body, place_body

__all__ = ["BESIDE_BYTES", "MAX_FRAME", "FrameReader", "encode_frame", "encode_frames", "frames"]

_LENGTH = struct.Struct("!I")
#: The largest frame a reader accepts. Far above any a relay sends (its channel drops a message past its
#: write bound, 20 MiB by default) and low enough that a garbled length never makes a reader buffer without end.
MAX_FRAME = 64 * 1024 * 1024
#: A request body past this travels in a frame of its own, right after its message's (``encode_frames``).
BESIDE_BYTES = 256 * 1024
#: The length's high bit: a frame of raw bytes (a body beside its message), not ``marshal``'s form.
_RAW = 1 << 31


def encode_frame(message: Raw) -> tuple[bytes, bytes]:
    """One message's length prefix and body, to be written one after the other (a turn's frames leave in one
    write, joined once there); ``WireError`` for a message ``marshal`` cannot encode or past ``MAX_FRAME``."""
    try:
        data = marshal.dumps(message)
    except ValueError as exc:
        raise WireError(f"a message that cannot be encoded: {exc}") from exc
    if len(data) > MAX_FRAME:
        raise WireError(f"a message of {len(data)} bytes, past the frame bound of {MAX_FRAME}")
    return _LENGTH.pack(len(data)), data


def encode_frames(message: Raw) -> list[bytes]:
    """``encode_frame``'s length prefix and body, and after them, for a message carrying a request body past
    ``BESIDE_BYTES``, the body in a raw frame of its own: the relay writes it as it is, never copied into the message's
    frame (a copy of milliseconds on its loop for a body of megabytes)."""
    message, body = lift_body(message, BESIDE_BYTES)
    prefix, data = encode_frame(message)
    if body is None:
        return [prefix, data]
    parts = [body] if isinstance(body, bytes) else list(body)
    size = sum(map(len, parts))
    if size > MAX_FRAME:
        raise WireError(f"a body of {size} bytes, past the frame bound of {MAX_FRAME}")
    return [prefix, data, _LENGTH.pack(size | _RAW), *parts]


def frames(buffer: bytearray) -> list[Raw]:
    """Take every complete message out of ``buffer``, leaving a partial frame's bytes in it.

    ``WireError`` when a frame cannot be read (the messages before it are lost with it: see ``FrameReader``)."""
    out: list[Raw] = []
    _take(buffer, out)
    return out


def _take(buffer: bytearray, out: list[Raw], keep: list[bytes] | None = None) -> None:
    at = 0
    size = len(buffer)
    try:
        # Read in place: no copy of a frame's bytes before ``marshal`` makes the message's own.
        with memoryview(buffer) as view:
            while size - at >= 4:
                length = _length(view, at, raw=False)
                if size - at - 4 < length:
                    break
                try:
                    message = marshal.loads(view[at + 4 : at + 4 + length])
                except (ValueError, EOFError, TypeError) as exc:
                    raise WireError(f"a frame of {length} bytes that cannot be read: {exc}") from exc
                if type(message) is not tuple or not message:
                    raise WireError(f"a frame that holds no message but a {type(message).__name__}")
                end = at + 4 + length
                if body_beside(message):
                    # Its body follows in a raw frame: the message waits for it (read again once it is all here).
                    if size - end < 4 or size - end - 4 < (beside := _length(view, end, raw=True)):
                        break
                    message = place_body(message, bytes(view[end + 4 : end + 4 + beside]))
                    end += 4 + beside
                out.append(message)
                at = end
    finally:
        if keep is not None and at:
            keep.append(bytes(buffer[:at]))
        del buffer[:at]


def _length(view: memoryview, at: int, *, raw: bool) -> int:
    """The length of the frame at ``at``, which must be a raw one or must not be (``WireError`` otherwise)."""
    length: int = _LENGTH.unpack_from(view, at)[0]
    if bool(length & _RAW) != raw:
        raise WireError("a body where a message was due, or none where one was" if raw else "raw bytes out of turn")
    length &= ~_RAW
    if length > MAX_FRAME:
        raise WireError(f"a frame of {length} bytes, past the bound of {MAX_FRAME}: the framing is lost")
    return length


class FrameReader:
    """One connection's read side: bytes in as they come, whole messages out; stops at the first bad frame."""

    __slots__ = ("_buffer", "_keep", "broken", "taken")

    def __init__(self, *, keep: bool = False) -> None:
        self._buffer = bytearray()
        #: Why the framing was lost (None: it was not); nothing more is read once it is set.
        self.broken: WireError | None = None
        #: With ``keep``: the bytes of the complete frames the last ``feed`` gave, as they came (the record journal
        #: keeps them so, ``llmtap.telemetry.journal.spool``).
        self.taken = b""
        self._keep: list[bytes] | None = [] if keep else None

    def feed(self, data: bytes) -> list[Raw]:
        """The complete messages ``data`` ends (those before a bad frame too)."""
        if self.broken is not None:
            return []
        self._buffer += data
        out: list[Raw] = []
        keep = self._keep
        try:
            _take(self._buffer, out, keep)
        except WireError as exc:
            self.broken = exc
            self._buffer = bytearray()
        if keep is not None:
            self.taken = keep.pop() if keep else b""
        return out

    @property
    def pending(self) -> int:
        """Bytes of a frame not complete yet."""
        return len(self._buffer)
