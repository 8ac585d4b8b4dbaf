"""A relay's ledger: what it handed to each telemetry process, in a small shared file the next start reads.

Issue 44. When the whole tree is killed (an OOM kill of the pod, a node lost), what a relay had handed over but no
telemetry process had journaled yet (in the socket, in the relay's gather), and what it was still relaying, is gone
with it; only the relay knew. So each relay keeps, in a file of the record journal's folder
(``DIR/relays/relay-ID.ledger``), a few counters as it goes: how many requests it has in flight now, and per
telemetry process the sequence number of the last stream end it handed over (``llmtap.wire.messages.End.seq``). The
file is ``mmap``'d: an update is a store into memory the kernel shares with the file (no system call on the relay's
path; the kernel writes it out, and keeps it through a kill of the process). The relay holds an ``flock`` on it
while it lives. At the next start each telemetry process reads the ledgers no live relay holds (``dead``),
compares with what its journal last saw of that relay, and says what never reached it
(``llmtap.telemetry.journal.spool``).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_SHARDS", "Ledger", "LedgerState", "dead", "mark_read", "new_relay_id"]

_MAGIC = 0x4C4C4D5441504C31  # "LLMTAPL1"
#: Telemetry processes a ledger counts for at most (past it, the rest are not counted).
MAX_SHARDS = 64
# Words: magic, relay id, shards, in flight, then per shard the last end handed over, then per shard "read".
_IN_FLIGHT = 3
_HANDED = 4
_WORDS = _HANDED + 2 * MAX_SHARDS
_SIZE = _WORDS * 8
_NAME = "relay-{:016x}.ledger"


def new_relay_id() -> int:
    """A relay's id: random, 63 bits (a pid is reused; this, for practical purposes, never)."""
    return secrets.randbits(63) or 1


class Ledger:
    """This relay's ledger, open for its lifetime (``close`` at exit)."""

    def __init__(self, directory: str | Path, relay_id: int, shards: int) -> None:
        folder = Path(directory) / "relays"
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / _NAME.format(relay_id)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(self._fd, _SIZE)
        self._map = mmap.mmap(self._fd, _SIZE)
        self._words = memoryview(self._map).cast("Q")
        self._words[1] = relay_id
        self._words[2] = min(shards, MAX_SHARDS)
        self._words[0] = _MAGIC
        self._shards = min(shards, MAX_SHARDS)

    def in_flight(self, n: int) -> None:
        """The relay has ``n`` requests between their admission to relaying and the hand-over of their tape."""
        self._words[_IN_FLIGHT] = n

    def handed(self, shard: int, seq: int) -> None:
        """The end numbered ``seq`` went into the channel to telemetry process ``shard``."""
        if shard < self._shards:
            self._words[_HANDED + shard] = seq

    def close(self) -> None:
        """Let the file go (kept: the next start reads it, and removes it)."""
        with contextlib.suppress(BufferError, ValueError, OSError):
            self._words.release()
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


@dataclass(frozen=True)
class LedgerState:
    """A dead relay's last counts, as its ledger holds them."""

    path: Path
    relay_id: int
    in_flight: int
    handed: tuple[int, ...]
    read: tuple[bool, ...]


def dead(directory: str | Path) -> Iterator[tuple[LedgerState, int]]:
    """The ledgers under ``directory`` that no live relay holds, each with a shared lock's descriptor held for the
    caller (``mark_read`` then ``os.close`` it)."""
    folder = Path(directory) / "relays"
    with contextlib.suppress(OSError):
        for path in sorted(folder.glob("relay-*.ledger")):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                data = os.pread(fd, _SIZE, 0)
            except OSError:
                os.close(fd)
                continue
            if len(data) < _SIZE or struct.unpack_from("Q", data)[0] != _MAGIC:
                os.close(fd)
                continue
            words = struct.unpack(f"{_WORDS}Q", data)
            shards = min(words[2], MAX_SHARDS)
            handed = words[_HANDED : _HANDED + shards]
            read = tuple(bool(w) for w in words[_HANDED + MAX_SHARDS : _HANDED + MAX_SHARDS + shards])
            yield LedgerState(path, words[1], words[_IN_FLIGHT], handed, read), fd


def mark_read(state: LedgerState, fd: int, shard: int) -> None:
    """Telemetry process ``shard`` has counted this dead relay's ledger; once every one has, the file goes."""
    with contextlib.suppress(OSError):
        os.pwrite(fd, struct.pack("Q", 1), (_HANDED + MAX_SHARDS + shard) * 8)
        data = os.pread(fd, _SIZE, 0)
        words = struct.unpack(f"{_WORDS}Q", data)
        shards = min(words[2], MAX_SHARDS)
        if all(words[_HANDED + MAX_SHARDS : _HANDED + MAX_SHARDS + shards]):
            state.path.unlink()
