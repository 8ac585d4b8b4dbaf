"""The ClickHouse scale benchmark (``bench.probes.clickhouse_scale``, ``bench.probes.scale``) at a small size, against
Debian's ClickHouse."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.probes import clickhouse_scale, scale
from llmtap.store import clickhouse as ch
from tests.support.clickhouse_server import ClickHouseProcess, started


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouseProcess]:
    with started(tmp_path_factory.mktemp("clickhouse")) as proc:
        yield proc


def test_the_scale_benchmark_runs_end_to_end_at_a_small_size(server: ClickHouseProcess, tmp_path: Path) -> None:
    pytest.importorskip("duckdb", reason="the generator is DuckDB SQL (bench.probes.records_gen)")
    remote = ch.Server.parse(server.url)
    ch.create_table(remote, "bench_small", ttl_days=0)
    rows = tmp_path / "rows.csv"
    _, columns = clickhouse_scale.generate(rows, 6000)
    clickhouse_scale.load(remote, "bench_small", columns, rows, chunk=256 << 10)  # several INSERTs
    assert server.count("bench_small") == 6000
    # Every column the table has came from the generator, by name.
    assert sorted(columns) == sorted(ch.column_kinds())
    source = ["--clickhouse", server.url, "--clickhouse-table", "bench_small", "--json"]
    argv = ["compare", *source, "--before", "v1", "--after", "v2", "--resamples", "200"]
    _, _, peak_rss_mb, _, out = scale.run_child(argv)
    assert str(json.loads(out)["verdict"]).startswith("caching gain") and peak_rss_mb > 10
