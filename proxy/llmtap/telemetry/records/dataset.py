"""The record dataset (``--record DIR``): each process appends its own JSON-lines files, partitioned by hour.

Layout, read as one dataset by ``llmtap.store.files.read_records`` (and any engine that reads hive-style
partitions): ``DIR/date=YYYY-MM-DD/hour=HH/<stem>.jsonl`` while a file is open, where the stem holds the time it
was opened and the writing process's instance id, so no two processes ever write one file. A file is closed
past ``max_bytes``, past ``rotate_s`` seconds or when the UTC hour turns; a closed file is compressed off the
request path by a small thread of the writer (``<stem>.jsonl.gz.part``, renamed to ``<stem>.jsonl.gz``, then the
``.jsonl`` removed; with ``parquet``, ``<stem>.parquet`` by the same steps), which then keeps the dataset within
``keep_bytes`` and ``keep_s`` by removing the oldest closed files (every process's: one folder, one budget).
A file that an outside tool (logrotate) renamed or removed is noticed at the next write (the path no longer
names the open file) and a new one is opened. A write that fails (a full disk) loses whole records
only, counted: what it cut short is cut off again (``ftruncate``), so no line is ever torn.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmtap.config.types import ConfigError
from llmtap.telemetry import sched
from llmtap.telemetry.identity import Identity
from llmtap.worker import Progress, QueueWorker

__all__ = ["RECORD_DROP_REASONS", "DatasetWriter"]

#: Seconds between flushes while requests keep coming (the file is flushed at once when traffic pauses).
FLUSH_INTERVAL = 1.0
#: Bytes of lines buffered before they leave in one write, whatever the time.
BUFFER_BYTES = 64 * 1024
#: Why a record was lost: ``no_space`` (a full disk, quota or file-size limit), ``io_error`` (any other failed
#: write), ``invalid`` (a value JSON cannot hold).
RECORD_DROP_REASONS = ("no_space", "io_error", "invalid")
#: An open ``.jsonl`` left untouched this long past the rotation interval belongs to no live writer (its process
#: died): retention may remove it like a closed file.
ORPHAN_GRACE = 120.0
OPEN_SUFFIX = ".jsonl"
CLOSED_SUFFIX = ".jsonl.gz"
PARQUET_SUFFIX = ".parquet"
PART_SUFFIX = ".part"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")

log = logging.getLogger("llmtap.telemetry")


def drop_reason(exc: OSError) -> str:
    """``no_space`` for a full disk, quota or file-size limit; ``io_error`` for any other failed write."""
    return "no_space" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "io_error"


def partition(when: float) -> str:
    """The partition folder of a file opened at ``when`` (epoch seconds): ``date=YYYY-MM-DD/hour=HH``."""
    t = datetime.fromtimestamp(when, UTC)
    return f"date={t:%Y-%m-%d}/hour={t:%H}"


def check_root(path: str | Path) -> Path:
    """``--record``'s folder, made if missing; a clear error for a file (the layout before schema version 2)."""
    root = Path(path)
    if root.is_file() or root.is_char_device():
        raise ConfigError(
            f"record folder {str(root)!r} is a file: --record now names a folder, where each process writes its "
            "own files (date=YYYY-MM-DD/hour=HH/*.jsonl); point it at a folder (llmtap compare still reads old files)"
        )
    if root.suffix == OPEN_SUFFIX and not root.exists():
        raise ConfigError(
            f"record folder {str(root)!r} looks like a file name: --record now names a folder, where each process "
            "writes its own files (date=YYYY-MM-DD/hour=HH/*.jsonl); name a folder, e.g. "
            f"{str(root.with_suffix(''))!r}"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".llmtap-probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"record folder {str(root)!r}: {exc.strerror or exc}") from None
    return root


class _WriteFailed(Exception):
    """A write that failed after ``whole`` of its lines got out (and stayed)."""

    def __init__(self, error: OSError, whole: int) -> None:
        super().__init__(error)
        self.error = error
        self.whole = whole


def _open_append(path: Path) -> io.FileIO:
    return io.FileIO(path, "ab")


class DatasetWriter:
    """Appends record lines to this process's own files under ``root``; a record sink (``write``, ``flush``, ``close``).

    Lines wait in a small buffer (``BUFFER_BYTES``) and leave in one write. A write that fails (a full disk)
    loses the lines it carried: each is counted through ``on_drop`` by reason (``RECORD_DROP_REASONS``), the
    failure is logged once, and every later flush tries again; the first that succeeds says so, once. A record is
    settled (``progress``, for the record journal) once its line was handed to the kernel, or dropped and counted.
    """

    #: Which sink this is, to the record journal (``llmtap.telemetry.journal.spool``).
    kind = "files"

    def __init__(
        self,
        root: str | Path,
        identity: Identity,
        *,
        max_bytes: int = 64 << 20,
        rotate_s: float = 3600.0,
        keep_bytes: int = 2048 << 20,
        keep_s: float = 7 * 86400.0,
        compress: bool = True,
        parquet: bool = False,
        on_drop: Callable[[str, int], None] | None = None,
        opener: Callable[[Path], io.FileIO] = _open_append,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = check_root(root)
        if parquet:
            try:
                import pyarrow.json
                import pyarrow.parquet  # noqa: F401
            except ImportError:
                raise ConfigError("--record-format parquet needs pyarrow: pip install 'llmtap[parquet]'") from None
        self.identity = identity
        self.max_bytes = max_bytes
        self.rotate_s = rotate_s
        self.keep_bytes = keep_bytes
        self.keep_s = keep_s
        self._opener = opener
        self._clock = clock
        self._on_drop = on_drop
        self._stem_tag = _UNSAFE.sub("_", identity.instance_id)[:96] or "llmtap"
        self._file: io.FileIO | None = None
        self._path: Path | None = None
        self._opened = 0.0
        self._partition = ""
        self._size = 0
        self._seq = 0
        # Set when a cut-short line could not be cut off again (truncate failed too): ended before the next one.
        self._torn = False
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._flushed = time.monotonic()
        self._failing = False
        self._lost_while_failing = 0
        self._said_invalid = False
        self.written = 0
        #: The records given and not yet written out (``llmtap.worker.Progress``).
        self.progress = Progress()
        #: Records lost, by reason.
        self.dropped: dict[str, int] = dict.fromkeys(RECORD_DROP_REASONS, 0)
        #: Closed files go to the compressor thread, which also applies retention.
        self._closer = _Closer(self, compress, parquet)

    @property
    def path(self) -> Path | None:
        """The file being written now (None before the first write)."""
        return self._path

    def write(self, record: dict[str, Any]) -> None:
        """Queue one record; the buffer leaves once a second at most, or when it is full."""
        try:
            line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"
        except ValueError as exc:
            if not self._said_invalid:
                self._said_invalid = True
                log.warning(
                    "record folder %s: a record could not be written as JSON (%s); such records are counted",
                    self.root,
                    exc,
                )
            self.progress.settle_now()
            self._drop("invalid", 1)
            return
        data = line.encode("utf-8")
        self.progress.hold()
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= BUFFER_BYTES or time.monotonic() - self._flushed >= FLUSH_INTERVAL:
            self.flush()

    def flush(self) -> None:
        """Write the buffered lines out; a failure drops them, counted, and is said once until a write succeeds."""
        self._flushed = time.monotonic()
        lines, self._pending, self._pending_bytes = self._pending, [], 0
        if not lines:
            # Idle (the recorder flushes each time its queue empties, at least as often as the relays report):
            # a file past its time is closed now, so it is compressed and readers see it whole within the hour.
            if self._file is not None and self._due(self._clock()):
                self._close_file()
            return
        try:
            self._flush_lines(lines)
        finally:
            # Written out or dropped and counted, every one.
            self.progress.release(len(lines))

    def _flush_lines(self, lines: list[bytes]) -> None:
        done = 0
        try:
            self._check_moved()
            while done < len(lines):
                end = self._batch_end(lines, done)
                self._write(lines[done:end])
                done = end
        except _WriteFailed as failed:
            self._failed(failed.error, len(lines) - done - failed.whole)
            return
        except OSError as exc:  # opening or rotating
            self._failed(exc, len(lines) - done)
            return
        if self._failing:
            self._failing = False
            log.warning(
                "record folder %s is written again; %d records were lost while it could not be",
                self.root,
                self._lost_while_failing,
            )
            self._lost_while_failing = 0

    def close(self, timeout: float = 5.0) -> None:
        """Flush, close the open file and compress it (within ``timeout``); later writes open a new file."""
        self.flush()
        self._close_file()
        self._closer.stop(timeout)

    # -- files -----------------------------------------------------------------------------------

    def _batch_end(self, lines: list[bytes], start: int) -> int:
        """Open or rotate the file as needed; the end of the lines from ``start`` that fit in it."""
        now = self._clock()
        if self._file is not None and (
            (self._size and self._size + len(lines[start]) > self.max_bytes) or self._due(now)
        ):
            self._close_file()
        if self._file is None:
            self._open(now)
        end, size = start + 1, self._size + len(lines[start])
        while end < len(lines) and size + len(lines[end]) <= self.max_bytes:
            size += len(lines[end])
            end += 1
        return end

    def _due(self, now: float) -> bool:
        """Whether the open file's time is up: ``rotate_s`` passed, or the UTC hour turned."""
        return now - self._opened >= self.rotate_s or partition(now) != self._partition

    def _open(self, now: float) -> None:
        self._seq += 1
        folder = self.root / partition(now)
        folder.mkdir(parents=True, exist_ok=True)
        opened = datetime.fromtimestamp(now, UTC)
        path = folder / f"{opened:%Y%m%dT%H%M%S}Z-{self._stem_tag}-{self._seq:04d}{OPEN_SUFFIX}"
        self._file = self._opener(path)
        self._path = path
        self._opened = now
        self._partition = partition(now)
        self._size = self._file.tell()
        self._torn = False

    def _close_file(self, *, hand_over: bool = True) -> None:
        file, path = self._file, self._path
        self._file = None
        if file is None:
            return
        with contextlib.suppress(OSError):
            file.close()
        if not hand_over or path is None:
            return
        if self._size:
            self._closer.offer(path)
        else:
            with contextlib.suppress(OSError):
                path.unlink()  # opened, then nothing got in

    def _check_moved(self) -> None:
        """An outside tool renamed or removed the open file: leave it to the tool and open a new one."""
        if self._file is None or self._path is None:
            return
        try:
            now = os.stat(self._path)
            same = (now.st_ino, now.st_dev) == _identity_of(self._file)
        except FileNotFoundError:
            same = False
        if not same:
            log.info("record file %s was moved or removed by another program; a new file is started", self._path)
            self._close_file(hand_over=False)

    def _write(self, lines: list[bytes]) -> None:
        """One write of whole lines; a failure cuts what it left of a line off again and says how many stayed whole."""
        assert self._file is not None
        lead = int(self._torn)
        data = b"\n" * lead + b"".join(lines)
        view, written, start = memoryview(data), 0, self._size
        try:
            while written < len(data):
                written += self._file.write(view[written:])
        except OSError as exc:
            keep = data.rfind(b"\n", 0, written) + 1
            if keep < written:
                try:
                    os.ftruncate(self._file.fileno(), start + keep)
                    written = keep
                except OSError:
                    pass  # the cut-short line stays; it is ended before the next one (``_torn``)
            self._size = start + written
            self._torn = written > keep
            raise _WriteFailed(exc, max(data.count(b"\n", 0, keep) - lead, 0)) from exc
        self._size = start + written
        self._torn = False
        self.written += len(lines)

    def _failed(self, exc: OSError, lost: int) -> None:
        reason = drop_reason(exc)
        if not self._failing:
            self._failing = True
            log.warning(
                "record folder %s cannot be written (%s); records are dropped and counted "
                "(llmtap_telemetry_records_dropped_total) until it can",
                self.root,
                exc.strerror or exc,
            )
        self._lost_while_failing += lost
        self._drop(reason, lost)

    def _drop(self, reason: str, n: int) -> None:
        if not n:
            return
        self.dropped[reason] += n
        if self._on_drop is not None:
            self._on_drop(reason, n)

    def open_files(self) -> set[Path]:
        """The file this writer has open (retention never removes it)."""
        return {self._path} if self._file is not None and self._path is not None else set()


#: Top-level string fields typed as strings, whatever they look like: an ISO time would be read as a timestamp,
#: a span id of digits only as a number.
_STRING_FIELDS = (
    "time", "trace_id", "span_id", "record_id", "response_id", "instance_id", "host", "llmtap_version", "route",
    "upstream", "protocol", "operation", "model", "response_model", "outcome", "error_type", "slo", "shape",
    "prompt_version", "queue_source", "prefill_source",
)  # fmt: skip


def _parquet_parse_options() -> Any:
    import pyarrow as pa
    import pyarrow.json as pa_json

    schema = pa.schema([(name, pa.string()) for name in _STRING_FIELDS])
    return pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="infer")


def _identity_of(file: io.FileIO) -> tuple[int, int]:
    st = os.fstat(file.fileno())
    return st.st_ino, st.st_dev


class _Closer(QueueWorker[Path]):
    """The writer's small thread: compresses closed files, then keeps the dataset within its bounds."""

    def __init__(self, writer: DatasetWriter, compress: bool, parquet: bool) -> None:
        # No bound: one closed file at a time is offered, a few per rotation at most.
        super().__init__("llmtap-records", restart=True, on_thread=sched.idle_here)
        self.writer = writer
        self.compress = compress
        self.parquet = parquet
        self._said = False
        #: Closed files compressed, and files removed by retention.
        self.compressed = 0
        self.removed = 0

    def offer(self, path: Path) -> None:
        """Compress ``path`` (closed) off the caller's thread."""
        self._put(path)

    def stop(self, timeout: float) -> None:
        """Finish what was offered within ``timeout``; a file left then stays ``.jsonl`` (still read)."""
        self._stop(timeout)

    def _serve(self) -> None:
        for path in self._items():
            try:
                if self.parquet:
                    self._to_parquet(path)
                elif self.compress:
                    self._compress(path)
                self.retain()
            except Exception:
                log.exception("record folder %s: could not tidy a closed file", self.writer.root)

    def _compress(self, path: Path) -> None:
        target = path.with_name(path.name[: -len(OPEN_SUFFIX)] + CLOSED_SUFFIX)
        part = target.with_name(target.name + PART_SUFFIX)
        try:
            with path.open("rb") as src, gzip.open(part, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(part, target)
        except FileNotFoundError:
            return  # removed meanwhile (by retention or by hand)
        except OSError as exc:
            with contextlib.suppress(OSError):
                part.unlink()
            if not self._said:
                self._said = True
                log.warning("record file %s stays uncompressed (%s)", path, exc.strerror or exc)
            return
        with contextlib.suppress(OSError):
            path.unlink()
        self.compressed += 1

    def _to_parquet(self, path: Path) -> None:
        """``X.jsonl`` -> ``X.parquet`` (zstd), by the same steps as the compression; a failure leaves the lines."""
        import pyarrow.json as pa_json
        import pyarrow.parquet as pq

        target = path.with_name(path.name[: -len(OPEN_SUFFIX)] + PARQUET_SUFFIX)
        part = target.with_name(target.name + PART_SUFFIX)
        try:
            table = pa_json.read_json(path, parse_options=_parquet_parse_options())
            pq.write_table(table, part, compression="zstd")
            os.replace(part, target)
        except FileNotFoundError:
            return
        except Exception as exc:  # pyarrow raises its own errors for what it cannot type
            with contextlib.suppress(OSError):
                part.unlink()
            if not self._said:
                self._said = True
                log.warning("record file %s stays JSON lines (not Parquet: %s)", path, exc)
            return
        with contextlib.suppress(OSError):
            path.unlink()
        self.compressed += 1

    def retain(self) -> None:
        """Remove the oldest files past ``keep_s`` or beyond ``keep_bytes`` in all; never an open one."""
        w = self.writer
        now = w._clock()
        keep_open = w.open_files()
        files: list[tuple[float, int, Path]] = []
        for path in w.root.rglob("*"):
            name = path.name
            if not name.endswith((CLOSED_SUFFIX, OPEN_SUFFIX, PARQUET_SUFFIX)):
                continue
            try:
                st = path.stat()
            except OSError:
                continue
            if path in keep_open:
                continue
            # Another live process's open file is young; one untouched for long is an orphan of a dead one.
            if name.endswith(OPEN_SUFFIX) and now - st.st_mtime < w.rotate_s + ORPHAN_GRACE:
                continue
            files.append((st.st_mtime, st.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        for mtime, size, path in files:
            if now - mtime <= w.keep_s and total <= w.keep_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                self.removed += 1
            total -= size
            for folder in (path.parent, path.parent.parent):
                if folder != w.root:
                    with contextlib.suppress(OSError):
                        folder.rmdir()  # only when empty
