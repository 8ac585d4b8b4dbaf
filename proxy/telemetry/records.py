"""Request records (``--record PATH``): one JSON line per finished request, for ``llmtap compare``.

A line holds the request's timings and their sources, its tokens and their sources, its prompt
fingerprint and version, its cache class and its SLO outcome; never prompt or completion text, headers
or error messages (which can quote a prompt). Lines are written by the recorder's worker thread, so
no file I/O runs on the event loop. The file rotates by size (``PATH`` -> ``PATH.1`` -> ``PATH.2`` ..)
and at most ``files`` files stay on disk; the buffer is flushed when the worker goes idle, on
``flush`` and on shutdown. A disk that fills up costs records, counted, never the worker.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from proxy.analysis.cachediag import Diagnosis
from proxy.analysis.stats import sorted_quantile
from proxy.analysis.summary import Summary
from proxy.analysis.timeline import Timeline
from proxy.labels import clean_or_none
from proxy.settings import SLO, ConfigError

#: The key that marks a line as a request record; its value is the schema version.
SCHEMA_KEY = "llmtap_record"
SCHEMA_VERSION = 1
#: Seconds between flushes while requests keep coming (the file is flushed at once when traffic pauses).
FLUSH_INTERVAL = 1.0
#: Bytes of lines buffered before they leave in one write, whatever the time.
BUFFER_BYTES = 64 * 1024
#: Why a record was lost: ``no_space`` (a full disk, quota or file-size limit), ``io_error`` (any other failed
#: write), ``invalid`` (a value JSON cannot hold).
RECORD_DROP_REASONS = ("no_space", "io_error", "invalid")
_OWN_PREFIX = b'{"' + SCHEMA_KEY.encode() + b'":'

log = logging.getLogger("llmtap.telemetry")


def _round(value: float | None) -> float | None:
    # Microseconds are more than the clock's honesty allows; shorter lines are cheaper to keep.
    return None if value is None else round(value, 6)


def _gaps(gaps: list[float]) -> dict[str, Any]:
    if not gaps:
        return {"n": 0}
    ordered = sorted(gaps)
    return {
        "n": len(ordered),
        "p50": _round(sorted_quantile(ordered, 0.5)),
        "p95": _round(sorted_quantile(ordered, 0.95)),
        "max": _round(ordered[-1]),
    }


def objective_line(slo: SLO | None) -> dict[str, Any] | None:
    """The objective a request was judged by, as its record keeps it (so ``llmtap slo`` needs no config)."""
    if slo is None:
        return None
    return {"shape": slo.shape, "percentile": slo.percentile, **slo.limits()}


def record_line(tl: Timeline, s: Summary, diag: Diagnosis | None) -> dict[str, Any]:
    """The record of one finished request (schema version 1).

    The strings a client or an upstream chose are ``clean``: a lone surrogate cannot be written as UTF-8,
    and the whole line would be lost."""
    req = tl.request
    out: dict[str, Any] = {
        SCHEMA_KEY: SCHEMA_VERSION,
        "time": datetime.fromtimestamp(tl.received_wall_ns / 1e9, UTC).isoformat(timespec="milliseconds"),
        "trace_id": tl.trace_id,
        "route": tl.route,
        "upstream": tl.upstream,
        "protocol": tl.protocol,
        "operation": req.operation if req else None,
        "model": clean_or_none(req.model) if req else None,
        "response_model": clean_or_none(tl.response_model),
        "stream": bool(req and req.stream),
        "status": tl.status_code,
        "outcome": tl.outcome,
        "error_type": clean_or_none(tl.error_type),
        "slo": s.slo,
        "shape": s.shape,
        "objective": objective_line(s.objective),
        "prompt_version": tl.prompt_version,
        "ttft": _round(s.ttft),
        "ttfb": _round(s.ttfb),
        "upstream_ttft": _round(s.upstream_ttft),
        "tpot": _round(s.tpot),
        "e2e": _round(s.e2e),
        "queue": _round(s.queue),
        "queue_source": s.queue_source if s.queue is not None else None,
        "prefill": _round(s.prefill),
        "prefill_source": s.prefill_source if s.prefill is not None else None,
        "decode": _round(s.decode),
        "server_decode": _round(s.server_decode),
        "slots": None
        if s.slots is None
        else {"value": s.slots.slots, "source": s.slots.source, "confidence": s.slots.confidence},
        "gaps": _gaps(s.gaps),
        "tokens": {
            "input": s.input_tokens,
            "input_source": s.input_source or None,
            "output": s.output_tokens,
            "output_source": s.output_source or None,
            "cache_read": s.cache_read_tokens,
            "cache_write": s.cache_write_tokens,
            "reasoning": s.reasoning_tokens,
        },
    }
    fp = diag.fingerprint if diag is not None else None
    out["prompt"] = (
        None
        if fp is None
        else {
            "regions": [{"name": r.name, "hash": r.digest, "tokens": r.tokens} for r in fp.regions],
            "shared_prefix_tokens": diag.shared_prefix_tokens if diag else 0,
        }
    )
    out["cache"] = (
        None
        if diag is None
        else {
            "class": diag.cache_class,
            "changed_region": diag.changed_region,
            "expected_prefix_tokens": diag.expected_prefix_tokens,
            "cached_tokens": diag.cached_tokens,
            "min_tokens": diag.min_tokens,
        }
    )
    return out


class _WriteFailed(Exception):
    """A write that failed after ``whole`` of its lines got out."""

    def __init__(self, error: OSError, whole: int) -> None:
        super().__init__(error)
        self.error = error
        self.whole = whole


def _open_append(path: Path) -> io.FileIO:
    return path.open("ab", buffering=0)


def drop_reason(exc: OSError) -> str:
    """``no_space`` for a full disk, quota or file-size limit; ``io_error`` for any other failed write."""
    return "no_space" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "io_error"


class RecordWriter:
    """Appends record lines to ``path``, rotating past ``max_bytes`` and keeping ``files`` files at most.

    Lines wait in a small buffer (``BUFFER_BYTES``) and leave in one write. A write that fails (a full disk)
    loses the lines it carried: each is counted through ``on_drop`` by reason (``RECORD_DROP_REASONS``),
    the failure is logged once, and every later flush tries again; the first that succeeds says so, once.
    A line a failed write cut short is ended before the next one, so it stays one bad line.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = 64 << 20,
        files: int = 5,
        on_drop: Callable[[str, int], None] | None = None,
        opener: Callable[[Path], io.FileIO] = _open_append,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.files = max(files, 1)
        self._opener = opener
        self._on_drop = on_drop
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: io.FileIO | None = opener(self.path)
        except OSError as exc:
            raise ConfigError(f"record file {str(self.path)!r}: {exc.strerror or exc}") from None
        self._size = self._file.tell()
        # A line cut short by a killed process or a failed write is ended before the next one is written.
        self._torn = bool(self._size) and not _ends_with_newline(self.path)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._flushed = time.monotonic()
        self._failing = False
        self._lost_while_failing = 0
        self._said_invalid = False
        self.written = 0
        #: Records lost, by reason.
        self.dropped: dict[str, int] = dict.fromkeys(RECORD_DROP_REASONS, 0)

    def write(self, record: dict[str, Any]) -> None:
        """Queue one record; the buffer leaves once a second at most, or when it is full."""
        try:
            line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"
        except ValueError as exc:
            if not self._said_invalid:
                self._said_invalid = True
                log.warning(
                    "record file %s: a record could not be written as JSON (%s); such records are counted",
                    self.path,
                    exc,
                )
            self._drop("invalid", 1)
            return
        data = line.encode("utf-8")
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= BUFFER_BYTES or time.monotonic() - self._flushed >= FLUSH_INTERVAL:
            self.flush()

    def flush(self) -> None:
        """Write the buffered lines out; a failure drops them, counted, and is said once until a write succeeds."""
        self._flushed = time.monotonic()
        lines, self._pending, self._pending_bytes = self._pending, [], 0
        done = 0
        try:
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
        if self._failing and lines:
            self._failing = False
            log.warning(
                "record file %s is written again; %d records were lost while it could not be",
                self.path,
                self._lost_while_failing,
            )
            self._lost_while_failing = 0

    def close(self) -> None:
        """Flush and close; later writes are an error."""
        self.flush()
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _batch_end(self, lines: list[bytes], start: int) -> int:
        """Open or rotate the file as needed; the end of the lines from ``start`` that fit in it."""
        if self._file is None:
            self._file = self._opener(self.path)
            self._size = self._file.tell()
        if self._size and self._size + len(lines[start]) > self.max_bytes:
            self._rotate()
        end, size = start + 1, self._size + len(lines[start])
        while end < len(lines) and size + len(lines[end]) <= self.max_bytes:
            size += len(lines[end])
            end += 1
        return end

    def _write(self, lines: list[bytes]) -> None:
        """One write of whole lines (after a newline that ends a torn one); a failure says how many got out whole."""
        assert self._file is not None
        lead = int(self._torn)
        data = b"\n" * lead + b"".join(lines)
        view, written = memoryview(data), 0
        try:
            while written < len(data):
                written += self._file.write(view[written:])
        except OSError as exc:
            whole = max(data.count(b"\n", 0, written) - lead, 0)
            raise _WriteFailed(exc, whole) from exc
        finally:
            self._size += written
            if written:
                self._torn = data[written - 1] != 0x0A
        self.written += len(lines)

    def _failed(self, exc: OSError, lost: int) -> None:
        reason = drop_reason(exc)
        if not self._failing:
            self._failing = True
            log.warning(
                "record file %s cannot be written (%s); records are dropped and counted "
                "(llmtap_telemetry_records_dropped_total) until it can",
                self.path,
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

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        # The oldest file falls off the end; the others move up one: PATH.(n-1) is the oldest kept.
        oldest = self.files - 1
        if oldest == 0:
            self.path.unlink(missing_ok=True)
        else:
            Path(f"{self.path}.{oldest}").unlink(missing_ok=True)
            for i in range(oldest - 1, 0, -1):
                older = Path(f"{self.path}.{i}")
                if older.exists():
                    os.replace(older, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self._file = self._opener(self.path)
        self._size = 0
        self._torn = False


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def record_files(path: str | Path) -> list[Path]:
    """``path`` and its rotated siblings (``path.1``, ``path.2`` ..), oldest first."""
    base = Path(path)
    pattern = re.compile(re.escape(base.name) + r"\.(\d+)")
    rotated: list[tuple[int, Path]] = []
    if base.parent.is_dir():
        for sibling in base.parent.iterdir():
            match = pattern.fullmatch(sibling.name)
            if match and sibling.is_file():
                rotated.append((int(match.group(1)), sibling))
    out = [p for _, p in sorted(rotated, reverse=True)]
    if base.is_file():
        out.append(base)
    return out


@dataclass(slots=True)
class ReadStats:
    """What reading record files found: records read and lines skipped, by reason."""

    files: list[str] = field(default_factory=list)
    records: int = 0
    truncated: int = 0
    foreign: int = 0
    other_schema: int = 0

    @property
    def skipped(self) -> int:
        """Lines that were not read as records."""
        return self.truncated + self.foreign + self.other_schema


def read_records(path: str | Path, stats: ReadStats) -> Iterator[dict[str, Any]]:
    """Every record in ``path`` and its rotated siblings, oldest file first; bad lines are counted in ``stats``.

    A line cut short (the proxy was killed, or is writing it now) is ``truncated``: the last line
    without its newline, or one of ours that does not parse. A line that is not a JSON object with
    ``llmtap_record`` is ``foreign``; one with another schema version is ``other_schema``. None of them
    stops the reading.
    """
    for file in record_files(path):
        stats.files.append(str(file))
        with file.open("rb") as f:
            for raw in f:
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except ValueError:
                    if not raw.endswith(b"\n") or raw.startswith(_OWN_PREFIX):
                        stats.truncated += 1
                    else:
                        stats.foreign += 1
                    continue
                if not isinstance(obj, dict) or SCHEMA_KEY not in obj:
                    stats.foreign += 1
                elif obj[SCHEMA_KEY] != SCHEMA_VERSION:
                    stats.other_schema += 1
                else:
                    stats.records += 1
                    yield obj
