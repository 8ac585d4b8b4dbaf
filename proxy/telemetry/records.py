"""Request records (``--record PATH``): one JSON line per finished request, for ``llmtap compare``.

A line holds the request's timings and their sources, its tokens and their sources, its prompt
fingerprint and version, its cache class and its SLO outcome; never prompt or completion text, headers
or error messages (which can quote a prompt). Lines are written by the recorder's worker thread, so
no file I/O runs on the event loop. The file rotates by size (``PATH`` -> ``PATH.1`` -> ``PATH.2`` ..)
and at most ``files`` files stay on disk; the buffer is flushed when the worker goes idle, on
``flush`` and on shutdown.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from proxy.analysis.cachediag import Diagnosis
from proxy.analysis.stats import sorted_quantile
from proxy.analysis.summary import Summary
from proxy.analysis.timeline import Timeline
from proxy.labels import clean_or_none
from proxy.settings import ConfigError

#: The key that marks a line as a request record; its value is the schema version.
SCHEMA_KEY = "llmtap_record"
SCHEMA_VERSION = 1
#: Seconds between flushes while requests keep coming (the file is flushed at once when traffic pauses).
FLUSH_INTERVAL = 1.0
_OWN_PREFIX = b'{"' + SCHEMA_KEY.encode() + b'":'


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


class RecordWriter:
    """Appends record lines to ``path``, rotating past ``max_bytes`` and keeping ``files`` files at most."""

    def __init__(self, path: str | Path, *, max_bytes: int = 64 << 20, files: int = 5) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.files = max(files, 1)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"record file {str(self.path)!r}: {exc.strerror or exc}") from None
        self._size = self._file.tell()
        if self._size and not _ends_with_newline(self.path):
            # A line cut short by a killed process: end it, so it stays one bad line and spoils no other.
            self._file.write("\n")
            self._size += 1
        self._flushed = time.monotonic()
        self.written = 0

    def write(self, record: dict[str, Any]) -> None:
        """Append one record; rotate first when it would push the file past ``max_bytes``."""
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"
        size = len(line.encode("utf-8"))
        if self._size and self._size + size > self.max_bytes:
            self._rotate()
        self._file.write(line)
        self._size += size
        self.written += 1
        if time.monotonic() - self._flushed >= FLUSH_INTERVAL:
            self.flush()

    def flush(self) -> None:
        """Push buffered lines to the operating system."""
        self._file.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        """Flush and close; later writes are an error."""
        if not self._file.closed:
            self._file.flush()
            self._file.close()

    def _rotate(self) -> None:
        self._file.close()
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
        self._file = self.path.open("a", encoding="utf-8")
        self._size = 0


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
