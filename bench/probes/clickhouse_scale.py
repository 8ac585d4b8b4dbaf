"""The record sink into ClickHouse (``python -m bench.probes.clickhouse_scale --sink N``), and the bulk load
``bench.probes.scale`` fills its tables with.

``--sink N`` generated records (``bench.probes.records_gen``) go through the record sink itself (``ClickHouseSink``,
JSONEachRow) into a real ClickHouse (Debian's ``clickhouse-server``, started as a plain process on free ports,
as the tests start it): the caller's cost per ``write`` and records per second. ``generate`` and ``load`` put a
week of generated records, flattened to the table's columns (``proxy/llmtap/store/clickhouse.sql``), into a
table with ``INSERT ... FORMAT CSV``; ``llmtap compare`` and ``llmtap slo`` over such tables are timed by
``python -m bench.probes.scale`` beside the other sources.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from bench.probes.records_gen import PODS, rows_sql
from llmtap.store import clickhouse as ch
from llmtap.telemetry.records.clickhouse import ClickHouseSink

ROOT = Path(__file__).resolve().parents[2]

#: The table's columns from a generated record (DuckDB SQL over ``rows_sql``'s columns).
FLAT = """
  llmtap_record AS schema,
  epoch(time::TIMESTAMPTZ)::BIGINT AS time,
  epoch(time::TIMESTAMPTZ) AS time_s,
  trace_id, span_id, instance_id, host, pid, llmtap_version, response_id,
  route, upstream, protocol, operation, model, response_model,
  stream::INT AS stream, status, outcome, error_type, slo, shape,
  objective.shape AS objective_shape, objective.percentile AS objective_percentile,
  objective.ttft AS objective_ttft, objective.tpot AS objective_tpot, NULL::DOUBLE AS objective_e2e,
  coalesce(prompt_version, '') AS prompt_version,
  ttft, ttfb, upstream_ttft, tpot, e2e, queue, queue_source, prefill, prefill_source, decode, server_decode,
  slots.value AS slots_value, slots.source AS slots_source, slots.confidence AS slots_confidence,
  gaps.n AS gaps_n, gaps.p50 AS gaps_p50, gaps.p95 AS gaps_p95, gaps.max AS gaps_max,
  tokens.input AS tokens_input, tokens.input_source AS tokens_input_source, tokens.output AS tokens_output,
  tokens.output_source AS tokens_output_source, tokens.cache_read AS tokens_cache_read,
  tokens.cache_write AS tokens_cache_write, tokens.reasoning AS tokens_reasoning,
  to_json(prompt)::VARCHAR AS prompt_json,
  cache.class AS cache_class, cache.changed_region AS cache_changed_region,
  cache.expected_prefix_tokens AS cache_expected_prefix_tokens, cache.cached_tokens AS cache_cached_tokens,
  cache.min_tokens AS cache_min_tokens,
  NULL::DOUBLE AS cost_amount, NULL::VARCHAR AS cost_status,
  NULL::DOUBLE AS request_ttft, NULL::DOUBLE AS request_tpot,
  NULL::VARCHAR AS request_ttft_outcome, NULL::VARCHAR AS request_tpot_outcome,
  trace_id || '-' || span_id AS record_id,
  ttft AS ttfot, NULL::DOUBLE AS ttst, NULL::DOUBLE AS objective_ttfot, NULL::DOUBLE AS objective_ttst,
  NULL::DOUBLE AS upstream_unattributed, NULL::BIGINT AS tokens_cache_write_1h,
  NULL::VARCHAR AS cost_currency, NULL::VARCHAR AS cost_source, NULL::VARCHAR AS cost_prices,
  NULL::VARCHAR AS attribution_json
"""


def generate(path: Path, n: int) -> tuple[float, list[str]]:
    """``n`` records as CSV rows of the table in ``path`` (``\\N`` for null); seconds taken, and the columns.

    CSV rather than JSONEachRow: ClickHouse 18.16 parses it several times faster, and the load is not what
    is measured here (the sink's own inserts are JSONEachRow)."""
    import duckdb

    started = time.monotonic()
    con = duckdb.connect(config={"threads": 2, "preserve_insertion_order": False})
    try:
        parts = " UNION ALL ".join(f"SELECT {FLAT} FROM ({rows_sql(n, pod)})" for pod in range(PODS))
        columns = list(con.sql(f"SELECT * FROM ({parts}) LIMIT 0").columns)
        con.execute(f"COPY ({parts}) TO '{path}' (FORMAT csv, HEADER false, NULLSTR '\\N', QUOTE '\"')")
    finally:
        con.close()
    return time.monotonic() - started, columns


def sink_throughput(server: ch.Server, n: int) -> dict[str, Any]:
    """``n`` generated records through the record sink (``--record-clickhouse``): the caller's cost per ``write``
    (what the recorder's worker pays) and records per second until ClickHouse holds them all."""
    import duckdb

    con = duckdb.connect(config={"threads": 2})
    try:
        rel = con.sql(rows_sql(n, 0, pods=1))
        names = rel.columns
        records = [dict(zip(names, row, strict=True)) for row in rel.fetchall()]
    finally:
        con.close()
    for rec in records:
        rec.pop("date", None), rec.pop("hour", None)
    sink = ClickHouseSink(server, "sink_throughput", ttl_days=0, max_records=n + 1, max_bytes=1 << 31)
    try:
        sink.write(records[0])
        assert sink.drain(600)  # the table made, the connection warm
        started = time.perf_counter()
        for rec in records[1:]:
            sink.write(rec)
        writing = time.perf_counter() - started
        assert sink.drain(3600)
        total = time.perf_counter() - started
    finally:
        sink.close()
    assert sink.written == n and not any(sink.dropped.values()), (sink.written, sink.dropped)
    return {
        "records": n,
        "write_us_per_record": round(writing / (n - 1) * 1e6, 1),
        "records_per_s": round((n - 1) / total),
        "inserts": sink.inserts["ok"],
    }


def load(server: ch.Server, table: str, columns: list[str], path: Path, chunk: int = 64 << 20) -> float:
    """The file's rows into ``table``, one INSERT per ``chunk`` bytes of whole lines; seconds."""
    started = time.monotonic()
    sql = f"INSERT INTO {table} ({', '.join(columns)}) FORMAT CSV"
    with path.open("rb") as f:
        rest = b""
        while True:
            block = f.read(chunk)
            if not block:
                break
            block, _, tail = (rest + block).rpartition(b"\n")
            rest = tail
            if block:
                _post(server, sql, block + b"\n")
        if rest.strip():
            _post(server, sql, rest + b"\n")
    return time.monotonic() - started


def _post(server: ch.Server, sql: str, body: bytes) -> None:
    url = server.url + "?" + urllib.parse.urlencode({"query": sql})
    with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=3600) as r:
        r.read()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sink", type=int, default=100_000, help="records sent through the record sink")
    p.add_argument("--dir", type=Path, help="where ClickHouse and the generated rows live (a temporary directory)")
    args = p.parse_args(argv)
    if args.sink < 2:
        p.error("--sink takes 2 records at least (the first warms the table and the connection)")
    # A run stopped from outside still stops its ClickHouse (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.path.insert(0, str(ROOT))
    from tests.support.clickhouse_server import ClickHouseProcess, installed

    if not installed():
        print("clickhouse-server is not installed (.ci/install.d/35-clickhouse.sh)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        proc = ClickHouseProcess(Path(tmp) / "clickhouse")
        proc.start(120)
        try:
            server = ch.Server.parse(proc.url)
            release = server.version()
            result = sink_throughput(server, args.sink)
            print(json.dumps({"clickhouse": f"{release[0]}.{release[1]}", "sink": result}), flush=True)
        finally:
            proc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
