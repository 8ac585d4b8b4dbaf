"""What writing request records costs the telemetry worker, and what they take on disk.

``python -m bench.probes.records`` writes ``--records`` records shaped like real ones (every field of schema 2, the
timings, tokens, hashes and ids varying from one to the next) through the record sinks as the recorder's
worker calls them: the dataset writer with gzip-compressed files (the default), with Parquet, and the OTLP log
sink with an exporter that takes every batch at once (the SDK's batching, not a network, is what the worker
pays for). For each it reports the worker's time per record (``write`` and its flushes; the compression and
the export run on their own threads), the bytes per record on disk, and the time to read the dataset back.
The figures depend on the machine and on what else runs on it: compare them with each other, run to run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult

from llmtap.store.files import ReadStats, read_records, record_files_at
from llmtap.telemetry.identity import current
from llmtap.telemetry.records.dataset import DatasetWriter
from llmtap.telemetry.records.logs import LogSink


def sample_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` records with every field of schema 2, their values varying as real traffic's do."""
    rnd = random.Random(seed)
    me = current()
    out = []
    for i in range(n):
        ttft = rnd.lognormvariate(-1.5, 0.6)
        tokens_in, tokens_out = rnd.randint(20, 4000), rnd.randint(1, 800)
        tpot = rnd.uniform(0.005, 0.05)
        out.append(
            {
                "llmtap_record": 2,
                "time": f"2026-01-01T00:{i // 60000 % 60:02d}:{i // 1000 % 60:02d}.{i % 1000:03d}+00:00",
                "trace_id": f"{rnd.getrandbits(128):032x}",
                "span_id": f"{rnd.getrandbits(64):016x}",
                "response_id": f"chatcmpl-{rnd.getrandbits(96):024x}",
                "instance_id": me.instance_id,
                "host": me.host,
                "pid": me.pid,
                "llmtap_version": me.version,
                "route": rnd.choice(("support", "code", "batch")),
                "upstream": "http://vllm:8000",
                "protocol": "openai",
                "operation": "chat",
                "model": "llama-3.1-8b",
                "response_model": "llama-3.1-8b",
                "stream": True,
                "status": 200,
                "outcome": "ok",
                "error_type": None,
                "slo": rnd.choice(("met", "missed")),
                "shape": rnd.choice(("short_prompt", "long_prompt")),
                "objective": {"shape": "short_prompt", "percentile": 95, "ttft": 0.5},
                "prompt_version": rnd.choice(("v1", "v2")),
                "ttft": round(ttft, 6),
                "ttfb": round(ttft * 0.9, 6),
                "upstream_ttft": round(ttft * 0.98, 6),
                "tpot": round(tpot, 6),
                "e2e": round(ttft + tpot * tokens_out, 6),
                "queue": round(rnd.uniform(0, 0.01), 6),
                "queue_source": "proxy",
                "prefill": round(ttft * 0.7, 6),
                "prefill_source": "estimated",
                "decode": round(tpot * tokens_out, 6),
                "server_decode": None,
                "slots": None,
                "gaps": {"n": tokens_out, "p50": round(tpot, 6), "p95": round(tpot * 2, 6), "max": round(tpot * 3, 6)},
                "tokens": {
                    "input": tokens_in,
                    "input_source": "usage",
                    "output": tokens_out,
                    "output_source": "usage",
                    "cache_read": rnd.choice((0, tokens_in // 2)),
                    "cache_write": None,
                    "reasoning": None,
                },
                "prompt": {
                    "regions": [
                        {"name": "system", "hash": f"{rnd.getrandbits(32):08x}", "tokens": tokens_in // 3},
                        {"name": "m0", "hash": f"{rnd.getrandbits(32):08x}", "tokens": tokens_in - tokens_in // 3},
                    ],
                    "shared_prefix_tokens": tokens_in // 3,
                },
                "cache": {
                    "class": rnd.choice(("hit", "cold", "miss_changed")),
                    "changed_region": None,
                    "expected_prefix_tokens": tokens_in // 3,
                    "cached_tokens": 0,
                    "min_tokens": 16,
                },
            }
        )
    return out


class _Taken(LogRecordExporter):
    """Takes every batch at once: the OTLP log sink's cost without a network."""

    def __init__(self) -> None:
        self.count = 0

    def export(self, batch: Sequence[Any]) -> LogRecordExportResult:
        self.count += len(batch)
        return LogRecordExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing to release."""

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def _timed(write: Callable[[dict[str, Any]], None], flush: Callable[[], None], recs: list[dict[str, Any]]) -> float:
    started = time.perf_counter()
    for rec in recs:
        write(rec)
    flush()
    return time.perf_counter() - started


def run(n: int, folder: Path) -> list[dict[str, Any]]:
    """One row per sink: worker microseconds per record, bytes per record on disk, seconds to read back."""
    recs = sample_records(n)
    raw = sum(len(json.dumps(r, separators=(",", ":"))) + 1 for r in recs) / n
    rows = []
    for name, parquet in (("files, gzip", False), ("files, parquet", True)):
        root = folder / name.replace(", ", "-")
        shutil.rmtree(root, ignore_errors=True)
        writer = DatasetWriter(root, current(), max_bytes=8 << 20, parquet=parquet)
        spent = _timed(writer.write, writer.flush, recs)
        writer.close(600)
        size = sum(f.stat().st_size for f in record_files_at(root))
        started = time.perf_counter()
        stats = ReadStats()
        read = sum(1 for _ in read_records(root, stats))
        assert read == n and stats.skipped == 0, (read, stats)
        rows.append(
            {
                "sink": name,
                "worker_us_per_record": round(spent / n * 1e6, 1),
                "json_bytes_per_record": round(raw),
                "disk_bytes_per_record": round(size / n, 1),
                "files": len(record_files_at(root)),
                "read_s": round(time.perf_counter() - started, 2),
            }
        )
    taken = _Taken()
    sink = LogSink(taken, capacity=4096, on_drop=lambda reason, k: None)
    spent = _timed(sink.write, sink.flush, recs)
    sink.close(600)
    rows.append(
        {
            "sink": "OTLP log records",
            "worker_us_per_record": round(spent / n * 1e6, 1),
            "json_bytes_per_record": round(raw),
            "disk_bytes_per_record": None,
            "files": None,
            "read_s": None,
            "exported": taken.count,
        }
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run and print a table (or JSON)."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.records", description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=50_000, help="records written through each sink (50000)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmtap-bench-records-") as tmp:
        rows = run(args.records, Path(tmp))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = ["sink", "worker_us_per_record", "json_bytes_per_record", "disk_bytes_per_record", "files", "read_s"]
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for row in rows:
        print("| " + " | ".join("–" if row[c] is None else str(row[c]) for c in columns) + " |")
    if any("exported" in r and r["exported"] != args.records for r in rows):
        print("some log records were not exported", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
