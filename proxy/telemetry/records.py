"""Request records (``--record DIR``): one JSON object per finished request, for ``llmtap compare`` and any engine.

A record holds the request's timings and their sources, its tokens and their sources, its prompt fingerprint
and version, its cache class and its SLO outcome, and who wrote it (instance id, host, pid, llmtap version) and
which trace it is (trace and root span ids, the upstream's response id); never prompt or completion text,
headers or error messages (which can quote a prompt). Its JSON Schema is published in
``docs/record.schema.json``. Where records go is ``proxy.telemetry.sinks`` (the dataset of files is
``proxy.telemetry.dataset``); reading them back, from a dataset folder or from the single file and its rotated
siblings that versions before schema 2 wrote, is here.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from proxy.analysis.cachediag import Diagnosis
from proxy.analysis.stats import sorted_quantile
from proxy.analysis.summary import Summary
from proxy.analysis.timeline import Timeline
from proxy.labels import clean_or_none
from proxy.settings import SLO
from proxy.telemetry.dataset import CLOSED_SUFFIX, OPEN_SUFFIX, PARQUET_SUFFIX
from proxy.telemetry.identity import Identity

#: The key that marks a line as a request record; its value is the schema version.
SCHEMA_KEY = "llmtap_record"
#: Version 2 added who wrote the record and which trace it is (``instance_id`` .. ``response_id``).
SCHEMA_VERSION = 2
#: The schema versions a reader takes.
READABLE_VERSIONS = (1, 2)
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


def objective_line(slo: SLO | None) -> dict[str, Any] | None:
    """The objective a request was judged by, as its record keeps it (so ``llmtap slo`` needs no config)."""
    if slo is None:
        return None
    return {"shape": slo.shape, "percentile": slo.percentile, **slo.limits()}


def record_line(tl: Timeline, s: Summary, diag: Diagnosis | None, writer: Identity) -> dict[str, Any]:
    """The record of one finished request (schema version 2), written by ``writer``.

    The strings a client or an upstream chose are ``clean``: a lone surrogate cannot be written as UTF-8,
    and the whole line would be lost."""
    req = tl.request
    out: dict[str, Any] = {
        SCHEMA_KEY: SCHEMA_VERSION,
        "time": datetime.fromtimestamp(tl.received_wall_ns / 1e9, UTC).isoformat(timespec="milliseconds"),
        "trace_id": tl.trace_id,
        "span_id": tl.span_id,
        "response_id": clean_or_none(tl.response_id),
        "instance_id": writer.instance_id,
        "host": writer.host,
        "pid": writer.pid,
        "llmtap_version": writer.version,
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


def record_files(path: str | Path) -> list[Path]:
    """The record files at ``path``, oldest first.

    A folder (``--record DIR``): every ``*.jsonl`` and ``*.jsonl.gz`` under it, by partition and name (a file's
    name starts with the time it was opened); of ``X.jsonl`` and ``X.jsonl.gz`` only the ``.gz`` (the plain one
    is being removed after its compression). A file (versions before schema 2): ``path`` and its rotated
    siblings (``path.1``, ``path.2`` ..).
    """
    base = Path(path)
    if base.is_dir():
        found = sorted(
            (
                p
                for p in base.rglob("*")
                if p.name.endswith((OPEN_SUFFIX, CLOSED_SUFFIX, PARQUET_SUFFIX)) and p.is_file()
            ),
            key=lambda p: (p.parent.as_posix(), p.name),
        )
        names = {p.name for p in found}

        def superseded(p: Path) -> bool:
            stem = p.name[: -len(OPEN_SUFFIX)]
            return p.name.endswith(OPEN_SUFFIX) and (stem + CLOSED_SUFFIX in names or stem + PARQUET_SUFFIX in names)

        return [p for p in found if not superseded(p)]
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
        try:
            yield from _read_file(file, stats)
        except FileNotFoundError:
            pass  # removed between the listing and the read (retention, or its compressed copy replaced it)
        except (OSError, EOFError, zlib.error):
            stats.truncated += 1  # a compressed file cut short, or unreadable


def _read_file(file: Path, stats: ReadStats) -> Iterator[dict[str, Any]]:
    if file.name.endswith(PARQUET_SUFFIX):
        yield from _read_parquet(file, stats)
        return
    opened = gzip.open(file, "rb") if file.name.endswith(".gz") else file.open("rb")
    with opened as f:
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
            elif obj[SCHEMA_KEY] not in READABLE_VERSIONS:
                stats.other_schema += 1
            else:
                stats.records += 1
                yield obj


def _read_parquet(file: Path, stats: ReadStats) -> Iterator[dict[str, Any]]:
    """The records of a Parquet file (``--record-format parquet``); needs ``pyarrow``."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise OSError(f"{file}: reading Parquet needs pyarrow (pip install 'llmtap[parquet]')") from None
    for obj in pq.read_table(file).to_pylist():
        if obj.get(SCHEMA_KEY) in READABLE_VERSIONS:
            stats.records += 1
            yield _without_absent(obj)
        else:
            stats.other_schema += 1


def _without_absent(obj: dict[str, Any]) -> dict[str, Any]:
    """A Parquet row as its JSON line was: a struct field absent from some lines (``gaps.p50`` when ``n`` is 0)
    reads back as null in every row; the line had no such key."""
    gaps = obj.get("gaps")
    if isinstance(gaps, dict) and not gaps.get("n"):
        obj["gaps"] = {"n": gaps.get("n", 0)}
    objective = obj.get("objective")
    if isinstance(objective, dict):
        obj["objective"] = {k: v for k, v in objective.items() if v is not None or k == "shape"}
    return obj
