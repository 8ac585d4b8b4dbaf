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

from llmtap.wire.messages import Raw, WireError

__all__ = ["MAX_FRAME", "FrameReader", "encode_frame", "frames"]

_LENGTH = struct.Struct("!I")
#: The largest frame a reader accepts. Far above any a relay sends (its channel drops a message past its
#: write bound, 20 MiB by default) and low enough that a garbled length never makes a reader buffer without end.
MAX_FRAME = 64 * 1024 * 1024


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
                (length,) = _LENGTH.unpack_from(view, at)
                if length > MAX_FRAME:
                    raise WireError(f"a frame of {length} bytes, past the bound of {MAX_FRAME}: the framing is lost")
                if size - at - 4 < length:
                    break
                try:
                    message = marshal.loads(view[at + 4 : at + 4 + length])
                except (ValueError, EOFError, TypeError) as exc:
                    raise WireError(f"a frame of {length} bytes that cannot be read: {exc}") from exc
                if type(message) is not tuple or not message:
                    raise WireError(f"a frame that holds no message but a {type(message).__name__}")
                out.append(message)
                at += 4 + length
    finally:
        if keep is not None and at:
            keep.append(bytes(buffer[:at]))
        del buffer[:at]


class FrameReader:
    """One connection's read side: bytes in as they come, whole messages out; stops at the first bad frame."""

    __slots__ = ("_buffer", "_keep", "broken", "taken")

    def __init__(self, *, keep: bool = False) -> None:
        self._buffer = bytearray()
        #: Why the framing was lost (None: it was not); nothing more is read once it is set.
        self.broken: WireError | None = None
        #: With ``keep``: the bytes of the complete frames the last ``feed`` gave, as they came (the record journal
        #: keeps them so, ``llmtap.telemetry.spool``).
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
