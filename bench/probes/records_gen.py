"""Synthetic request records in llmtap's own record format, at scale, written by DuckDB.

One week of traffic through three routes (a long-prompt support assistant, code completion, a chat),
prompt version v1 for the first half and v2 (cache-friendly: more cached tokens, lower TTFT on the
support route) for the second, from six pods, each writing its own files in the dataset's layout
``DIR/date=YYYY-MM-DD/hour=HH/<pod>-N.jsonl.gz``. The lines have every field ``record_line`` writes
(schema 2: with ``instance_id``, ``host``, ``pid``, ``span_id``, ``response_id``), about 1.2 KB each.

Rows are made in SQL from their index with a hash per field (deterministic, and parallel), so ten
million lines take seconds of engine time rather than a ``json.dumps`` each; the same rows can be
written as Parquet (the record's nested structure, zstd).
"""

from __future__ import annotations

from pathlib import Path

PODS = 6
#: The week: 2026-11-23 00:00 UTC and seven days on; v2 from the middle.
WEEK_START = 1795392000.0
WEEK = 7 * 86400.0
SWITCH = WEEK_START + WEEK / 2


def _u(k: int) -> str:
    """A uniform draw in (0, 1) from the row index (SQL)."""
    return f"((hash(i, {k}) % 1000003 + 1) / 1000004.0)"


def _normal(k: int) -> str:
    return f"(sqrt(-2 * ln({_u(k)})) * cos(2 * pi() * {_u(k + 1)}))"


def rows_sql(n: int, pod: int, pods: int = PODS) -> str:
    """The records of one pod as SQL rows (the columns of a record, nested where the record nests)."""
    per = n // pods + (1 if pod < n % pods else 0)
    # Each pod's i runs over the whole index range, so the pods interleave in time.
    route = "['support', 'completion', 'chat'][1 + (hash(i, 3) % 3)::INT]"
    return f"""
WITH idx AS (SELECT range * {pods} + {pod} AS i FROM range({per})),
a AS (
  SELECT i,
    {WEEK_START} + (i / {max(n, 1)}.0) * {WEEK} + {_u(1)} AS ts,
    {route} AS route,
    CASE WHEN {_u(4)} < 0.3 THEN 'long' ELSE 'short' END AS shape,
    {_u(5)} < 0.9 AS stream,
    {_u(6)} < 0.01 AS failed,
    {_normal(7)} AS z,
    {_normal(9)} AS z2,
    (200 + {_u(11)} * 6000)::INT AS input
  FROM idx
),
b AS (
  SELECT *,
    CASE WHEN ts < {SWITCH} THEN 'v1' ELSE 'v2' END AS version,
    CASE route WHEN 'support' THEN 'llama-3.1-70b' WHEN 'completion' THEN 'qwen2.5-coder-7b'
         ELSE 'llama-3.1-8b' END AS model,
    CASE WHEN ts >= {SWITCH} AND route = 'support' THEN (input * (0.6 + 0.3 * {_u(12)}))::INT
         WHEN {_u(13)} < 0.2 THEN (input * 0.3)::INT ELSE 0 END AS cached
  FROM a
),
c AS (
  SELECT *,
    round(0.02 + (input - cached) / 9000.0 * (1 + 0.1 * z2), 6) AS prefill_s,
    round(exp(-3.5 + 0.25 * z2), 6) AS tpot_s,
    (20 + {_u(14)} * 400)::INT AS output
  FROM b
),
d AS (
  SELECT *,
    round(prefill_s + exp(-3 + 0.5 * z), 6) AS ttft_s
  FROM c
)
SELECT
  2 AS llmtap_record,
  strftime(make_timestamp((ts * 1e6)::BIGINT), '%Y-%m-%dT%H:%M:%S.%g+00:00') AS time,
  md5(i::VARCHAR) AS trace_id,
  left(md5((i + 1)::VARCHAR), 16) AS span_id,
  'llmtap-pod-{pod}-7f9c4-1795300000' AS instance_id,
  'llmtap-7f9c4-pod{pod}' AS host,
  1 AS pid,
  '0.2.0' AS llmtap_version,
  route,
  'http://vllm-' || route || ':8000' AS upstream,
  'openai' AS protocol,
  'chat' AS operation,
  model,
  model AS response_model,
  stream,
  CASE WHEN failed THEN 500 ELSE 200 END AS status,
  CASE WHEN failed THEN 'error' ELSE 'ok' END AS outcome,
  CASE WHEN failed THEN 'http_500' END AS error_type,
  CASE WHEN failed OR ttft_s > 0.8 THEN 'missed' ELSE 'met' END AS slo,
  shape,
  {{'shape': shape, 'percentile': 0.95, 'ttft': 0.8, 'tpot': 0.05}} AS objective,
  version AS prompt_version,
  CASE WHEN stream AND NOT failed THEN ttft_s END AS ttft,
  CASE WHEN stream AND NOT failed THEN round(ttft_s - 0.002, 6) END AS ttfb,
  CASE WHEN stream AND NOT failed THEN round(ttft_s - 0.0004, 6) END AS upstream_ttft,
  CASE WHEN NOT failed THEN tpot_s END AS tpot,
  round(ttft_s + tpot_s * output, 6) AS e2e,
  round(0.001 * {_u(15)}, 6) AS queue,
  'measured' AS queue_source,
  CASE WHEN stream AND NOT failed THEN prefill_s END AS prefill,
  CASE WHEN stream AND NOT failed THEN 'estimated' END AS prefill_source,
  round(tpot_s * (output - 1), 6) AS decode,
  NULL::DOUBLE AS server_decode,
  {{'value': 8, 'source': 'estimated', 'confidence': 0.7}} AS slots,
  {{'n': output - 1, 'p50': round(tpot_s * 0.95, 6), 'p95': round(tpot_s * 1.8, 6), 'max': round(tpot_s * 4.2, 6)}}
    AS gaps,
  {{'input': input, 'input_source': 'usage', 'output': output, 'output_source': 'usage',
    'cache_read': cached, 'cache_write': 0, 'reasoning': NULL::INT}} AS tokens,
  {{'regions': [
      {{'name': 'system', 'hash': left(md5(route || version), 16), 'tokens': (input * 0.5)::INT}},
      {{'name': 'tools', 'hash': left(md5(route || 'tools'), 16), 'tokens': (input * 0.1)::INT}},
      {{'name': 'history', 'hash': left(md5((i % 97)::VARCHAR), 16), 'tokens': (input * 0.3)::INT}},
      {{'name': 'user', 'hash': left(md5((i + 7)::VARCHAR), 16), 'tokens': (input * 0.1)::INT}}],
    'shared_prefix_tokens': cached}} AS prompt,
  {{'class': CASE WHEN cached > 0 THEN 'hit' WHEN version = 'v1' THEN 'prefix_changed' ELSE 'miss' END,
    'changed_region': CASE WHEN cached > 0 THEN NULL ELSE 'system' END,
    'expected_prefix_tokens': (input * 0.6)::INT, 'cached_tokens': cached, 'min_tokens': 1024}} AS cache,
  'chatcmpl-' || left(md5((i + 3)::VARCHAR), 24) AS response_id,
  strftime(make_timestamp((ts * 1e6)::BIGINT), '%Y-%m-%d') AS date,
  strftime(make_timestamp((ts * 1e6)::BIGINT), '%H') AS hour
FROM d
"""


def generate(
    directory: Path | None, n: int, *, parquet: Path | None = None, pods: int = PODS, threads: int = 2
) -> None:
    """Write ``n`` records as six pods would, compressed JSON lines under ``directory`` when given (and
    Parquet under ``parquet`` when given), both partitioned by date and hour: one file per pod and hour,
    as each pod's writer rotates its file when the UTC hour turns."""
    import duckdb

    for d in (directory, parquet):
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(config={"threads": threads, "preserve_insertion_order": False})
    con.execute("SET enable_progress_bar = false")
    try:
        for pod in range(pods):
            sql = rows_sql(n, pod, pods)
            if directory is not None:
                con.execute(
                    f"COPY ({sql}) TO '{directory}' (FORMAT json, COMPRESSION gzip, PARTITION_BY (date, hour),"
                    f" FILE_EXTENSION 'jsonl.gz', FILENAME_PATTERN 'pod{pod}-{{i}}', OVERWRITE_OR_IGNORE)"
                )
            if parquet is not None:
                con.execute(
                    f"COPY ({sql}) TO '{parquet}' (FORMAT parquet, COMPRESSION zstd, PARTITION_BY (date, hour),"
                    f" FILENAME_PATTERN 'pod{pod}-{{i}}', OVERWRITE_OR_IGNORE)"
                )
    finally:
        con.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.probes.records_gen DIR N [--parquet DIR]`` (``-`` as DIR: no JSON lines)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.probes.records_gen", description=__doc__.split("\n")[0])
    p.add_argument("dir", help="where the JSON lines go ('-': none)")
    p.add_argument("n", type=int, help="how many records")
    p.add_argument("--parquet", type=Path, help="where the same rows go as Parquet")
    args = p.parse_args(argv)
    generate(None if args.dir == "-" else Path(args.dir), args.n, parquet=args.parquet)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
