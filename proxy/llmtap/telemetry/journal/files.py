"""The record journal's files: a slot per telemetry process, segments of framed tape messages, an acknowledgement log.

What the relays send a telemetry process is appended here as it arrives (``llmtap.telemetry.journal.spool`` decides what
and when, and what it means); this module only writes and reads the bytes, and says what it could not read.

Layout: ``DIR/slot-N/`` per telemetry process (``take_slot``: the first slot from N on that no live process holds,
by an ``flock`` on ``DIR/slot-N/lock`` that the kernel lets go when its holder dies, so a restarted process finds
its predecessor's slot free and the relays' ledgers, ``llmtap.wire.ledger``, work the same way). In a slot:

* ``rRRRRRRRR-SSSSSSSS.seg``: segments of run ``R`` (one run per process start), numbered ``S``. A segment is a
  run of chunks, each ``CHUNK`` (payload length, CRC-32, source, first reference) then the payload: the complete
  frames (``llmtap.wire.framing``) one read of one relay's channel gave, as they came. One chunk is one
  ``write()``. The CRC covers the source, the reference and the payload, so a chunk a kill cut short or a crash
  left as zeros is found and skipped (``Chunks.torn``), never read as another.
* ``acks``: chunks of the same shape (source ``ACK_SOURCE``) whose payload is ``ACK`` entries: a request's
  reference and the bits (``llmtap.telemetry.journal.spool``) of what has its record by now. Rewritten without the
  entries of deleted segments once it grows (``AckLog.compact``).

Durability: the file writes go to the kernel at once (no buffer here), so a process killed, by SIGKILL or the
OOM killer, loses nothing it wrote. A node that loses power loses what the kernel had not written out: segments
and the acknowledgement log are synced (``fdatasync``) when a segment closes and every ``SYNC_EVERY`` seconds
(``llmtap.telemetry.journal.spool``), so a crash loses at most that long of records, and the chunk's CRC finds what it
cut short.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ACK",
    "ACK_SOURCE",
    "CHUNK",
    "EMITTED",
    "SETTLED",
    "SINK_BITS",
    "AckLog",
    "Chunks",
    "Req",
    "Seg",
    "SegmentFile",
    "Slot",
    "read_chunks",
    "segment_name",
    "take_slot",
]

#: Bits of an acknowledgement: which sink has the record; ``EMITTED``: its spans, metrics and listeners were made;
#: ``SETTLED``: nothing more is to be done with it.
SINK_BITS = {"files": 1, "clickhouse": 2, "logs": 4}
EMITTED = 64
SETTLED = 128
#: A chunk's head: payload length, CRC-32 (of the rest of the head and the payload), source, first reference.
CHUNK = struct.Struct("!IIiQ")
#: An acknowledgement: a request's reference and what has its record (bits, ``llmtap.telemetry.journal.spool``).
ACK = struct.Struct("!QB")
#: The source of an acknowledgement log's chunks.
ACK_SOURCE = -1
#: A chunk longer than this is not a chunk: what follows a garbled length is not read.
MAX_CHUNK = 128 * 1024 * 1024
#: Slots tried from a process's own index on, before the journal is given up (said in the log).
MAX_SLOTS = 64
_SEGMENT = re.compile(r"^r(\d{8})-(\d{8})\.seg$")


def segment_name(run: int, number: int) -> str:
    """The file name of segment ``number`` of run ``run``."""
    return f"r{run:08d}-{number:08d}.seg"


def _pack(source: int, ref: int, payload: bytes) -> bytes:
    meta = CHUNK.pack(len(payload), 0, source, ref)[8:]
    return CHUNK.pack(len(payload), zlib.crc32(payload, zlib.crc32(meta)), source, ref)


@dataclass
class Chunks:
    """A file's chunks, read whole: ``(source, first reference, payload)`` each, and the bytes at its end that are
    not a whole chunk (``torn``: a kill cut the last write short, or a crash left it unwritten)."""

    items: list[tuple[int, int, bytes]] = field(default_factory=list)
    torn: int = 0


def read_chunks(path: Path) -> Chunks:
    """Every whole chunk of ``path`` in order; reading stops at the first that is cut short or fails its CRC
    (nothing after it can be trusted to start where a chunk starts). A file that cannot be read has none."""
    out = Chunks()
    try:
        data = path.read_bytes()
    except OSError:
        return out
    at, size = 0, len(data)
    view = memoryview(data)
    while size - at >= CHUNK.size:
        length, crc, source, ref = CHUNK.unpack_from(data, at)
        end = at + CHUNK.size + length
        if length > MAX_CHUNK or end > size:
            break
        payload = view[at + CHUNK.size : end]
        if zlib.crc32(payload, zlib.crc32(view[at + 8 : at + CHUNK.size])) != crc:
            break
        out.items.append((source, ref, bytes(payload)))
        at = end
    out.torn = size - at
    return out


class _Appended:
    """A journal file open for appending on ``fd``: synced and closed the same way, whatever it holds."""

    fd: int

    def sync(self) -> None:
        """What was written, onto the disk (a crash of the node no longer loses it)."""
        with contextlib.suppress(OSError):
            os.fdatasync(self.fd)

    def close(self) -> None:
        """Synced and closed."""
        self.sync()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class SegmentFile(_Appended):
    """One segment, open for appending: each ``append`` is one ``write()`` of a whole chunk."""

    def __init__(self, path: Path, run: int, number: int, first_ref: int) -> None:
        self.path = path
        self.run = run
        self.number = number
        #: The first reference a request whose head is in this segment can have (references only grow).
        self.first_ref = first_ref
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(self.fd).st_size

    def append(self, source: int, ref: int, payload: bytes) -> None:
        """One chunk; ``OSError`` when it did not all get written (what did is cut off again, if it can be)."""
        head = _pack(source, ref, payload)
        want = len(head) + len(payload)
        try:
            written = os.writev(self.fd, (head, payload))
        except OSError:
            self._cut()
            raise
        if written != want:  # a full disk part way: a torn chunk would hide every later one from the reader
            self._cut()
            raise OSError(errno.ENOSPC, "the record journal's disk is full")
        self.size += want

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, self.size)


class AckLog(_Appended):
    """The slot's acknowledgements: appended in chunks, read back into the last bits known per reference."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(self.fd).st_size
        #: The size after the last compaction: the log is compacted again once it doubles.
        self.compacted = self.size

    @staticmethod
    def read(path: Path) -> tuple[dict[int, int], int]:
        """The bits each reference has, every entry's bits together; and the bytes at the end that were torn."""
        chunks = read_chunks(path)
        bits: dict[int, int] = {}
        for _, _, payload in chunks.items:
            for ref, mask in ACK.iter_unpack(payload[: len(payload) - len(payload) % ACK.size]):
                bits[ref] = bits.get(ref, 0) | mask
        return bits, chunks.torn

    def append(self, entries: list[tuple[int, int]]) -> None:
        """Entries in one write; ``OSError`` when they could not be written."""
        payload = b"".join([ACK.pack(ref, mask) for ref, mask in entries])
        head = _pack(ACK_SOURCE, 0, payload)
        written = os.writev(self.fd, (head, payload))
        if written != len(head) + len(payload):
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.size)
            raise OSError(errno.ENOSPC, "the record journal's disk is full")
        self.size += written

    def compact(self, keep: dict[int, int]) -> None:
        """Rewrite the log with ``keep`` alone (written aside, then renamed over it: a kill leaves one or the other)."""
        aside = self.path.with_name(self.path.name + ".new")
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            entries = list(keep.items())
            for start in range(0, len(entries), 65536):
                part = entries[start : start + 65536]
                payload = b"".join([ACK.pack(ref, mask) for ref, mask in part])
                os.writev(fd, (_pack(ACK_SOURCE, 0, payload), payload))
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(aside, self.path)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self.size = self.compacted = os.fstat(self.fd).st_size


class Slot:
    """One telemetry process's part of the journal folder, held (``flock``) while the process lives."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd = lock_fd
        self.acks = path / "acks"

    def segments(self) -> list[tuple[int, int, Path]]:
        """Every segment here, oldest first: ``(run, number, path)``."""
        found = []
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.path):
                match = _SEGMENT.match(entry.name)
                if match:
                    found.append((int(match.group(1)), int(match.group(2)), Path(entry.path)))
        found.sort()
        return found

    def next_run(self) -> int:
        """The run number of a process starting now: one past every run whose segments are here."""
        return max((run for run, _, _ in self.segments()), default=0) + 1

    def release(self) -> None:
        """Let the slot go (the process is ending; the kernel would let it go anyway)."""
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


class Req:
    """One request journaled: its reference, the segments holding its messages, what has it by now."""

    __slots__ = ("ended", "mask", "ref", "segs", "source")

    def __init__(self, ref: int, source: int, mask: int = 0) -> None:
        self.ref = ref
        self.source = source
        self.mask = mask
        self.segs: list[tuple[int, int]] = []
        self.ended = False


class Seg:
    """A segment: its file, its size, the requests in it not done, whether it is still written."""

    __slots__ = ("closed", "file", "first_ref", "ident", "outstanding", "path", "size")

    def __init__(self, ident: tuple[int, int], path: Path, size: int, first_ref: int, file: SegmentFile | None) -> None:
        self.ident = ident
        self.path = path
        self.size = size
        self.first_ref = first_ref
        self.file = file
        self.outstanding = 0
        self.closed = file is None


def _try_lock(path: Path) -> int | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def take_slot(root: Path, first: int) -> Slot:
    """The first slot from ``first`` on that no live process holds; ``OSError`` when the folder cannot be written
    or ``MAX_SLOTS`` are all held."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f".probe-{os.getpid()}"
    probe.touch()
    probe.unlink()
    for index in range(first, first + MAX_SLOTS):
        path = root / f"slot-{index}"
        fd = _try_lock(path)
        if fd is not None:
            return Slot(path, fd)
    raise OSError(errno.EBUSY, f"all {MAX_SLOTS} journal slots from slot-{first} on are held by live processes")
