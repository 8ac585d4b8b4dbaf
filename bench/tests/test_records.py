"""The records benchmark (``bench.probes.records``): each sink's figures at a small size."""

from __future__ import annotations

from pathlib import Path

from bench.probes import records as bench_records


def test_the_records_benchmark_runs_and_its_figures_hang_together(tmp_path: Path) -> None:
    rows = {r["sink"]: r for r in bench_records.run(300, tmp_path)}
    gzip_row, parquet_row, logs_row = rows["files, gzip"], rows["files, parquet"], rows["OTLP log records"]
    assert logs_row["exported"] == 300
    for row in (gzip_row, parquet_row):
        assert 0 < row["disk_bytes_per_record"] < row["json_bytes_per_record"] and row["files"] >= 1
    assert all(r["worker_us_per_record"] > 0 for r in rows.values())
