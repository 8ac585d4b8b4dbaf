"""Records in ClickHouse: the table on Debian's ClickHouse 18.16 and on a current one (chDB), the sink from a real
proxy, ClickHouse down and back, and ``compare``/``slo`` reading ClickHouse with the verdicts of the record file."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap import cli
from llmtap.analysis.compare import Split
from llmtap.commands import compare
from llmtap.config.load import build
from llmtap.config.types import ConfigError
from llmtap.simulator import get_profile, run_in_thread
from llmtap.store import clickhouse as ch, clickhouse_read as chread
from llmtap.telemetry.records.clickhouse import ClickHouseSink
from llmtap.telemetry.records.record import SCHEMA_VERSION
from tests.conftest import PATIENCE, free_port, require_real
from tests.support.clickhouse_server import HOW, PASSWORD, USER, ClickHouseProcess, installed, started
from tests.support.fault_load import wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouseProcess]:
    with started(tmp_path_factory.mktemp("clickhouse")) as proc:
        yield proc


def make_records(n: int, seed: int = 7, start: float = 1_790_000_000.0) -> list[dict[str, Any]]:
    """Records of two prompt versions (v2 caches: faster, cache reads), some failed, with objectives."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for i in range(n):
        version = "v1" if i < n // 2 else "v2"
        ok = rng.random() > 0.1
        stream = rng.random() > 0.2
        ttft = rng.lognormvariate(-0.5 if version == "v1" else -1.6, 0.3)
        shape = rng.choice(["short", "long"])
        out.append(
            {
                "llmtap_record": SCHEMA_VERSION,  # 2 once the writer writes schema 2
                "time": datetime.fromtimestamp(start + i * 0.75, UTC).isoformat(timespec="milliseconds"),
                "trace_id": f"{i:032x}",
                "span_id": f"{i:016x}",
                "instance_id": f"host-a-{100 + i % 3}-1790000000",
                "host": "host-a",
                "pid": 100 + i % 3,
                "llmtap_version": "0.test",
                "response_id": None if i % 4 else f"chatcmpl-{i}",
                "route": rng.choice(["chat", "chat", "code"]),
                "upstream": "http://upstream:8000",
                "protocol": "openai_chat",
                "operation": "chat",
                "model": "m1",
                "response_model": "m1",
                "stream": stream,
                "status": 200 if ok else 503,
                "outcome": "ok" if ok else "error",
                "error_type": None if ok else "503",
                "slo": ("met" if ttft < 0.5 else "missed") if ok else "missed",
                "shape": shape,
                "objective": {"shape": shape, "percentile": 0.95, "ttft": 0.5, "tpot": 0.05},
                "prompt_version": version,
                "ttft": round(ttft, 6) if stream else None,
                "ttfb": round(ttft * 0.9, 6),
                "upstream_ttft": round(ttft * 0.95, 6),
                "tpot": round(rng.uniform(0.01, 0.06), 6) if ok else None,
                "e2e": round(ttft + rng.uniform(0.5, 2.0), 6),
                "queue": None,
                "queue_source": None,
                "prefill": round(ttft * 0.8, 6),
                "prefill_source": "estimated",
                "decode": 1.0,
                "server_decode": None,
                "slots": {"value": 2, "source": "gauge", "confidence": 0.75},
                "gaps": {"n": 3, "p50": 0.02, "p95": 0.04, "max": 0.05},
                "tokens": {
                    "input": 1200,
                    "input_source": "usage",
                    "output": 40,
                    "output_source": "usage",
                    "cache_read": 0 if version == "v1" else 1024,
                    "cache_write": None,
                    "reasoning": None,
                },
                "prompt": {"regions": [{"name": "system", "hash": "ab12", "tokens": 1024}], "shared_prefix_tokens": 0},
                "cache": {
                    "class": "cold" if version == "v1" else "hit",
                    "changed_region": None,
                    "expected_prefix_tokens": 1024,
                    "cached_tokens": 0 if version == "v1" else 1024,
                    "min_tokens": 16,
                },
            }
        )
    return out


def _run(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    out = io.StringIO()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out):
            code = cli.main(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return code, out.getvalue()


# -- no server needed ------------------------------------------------------------------------------


def test_a_record_becomes_a_row_of_every_column_and_back() -> None:
    rec = make_records(1)[0]
    row = ch.flat_row(rec)
    assert row is not None
    columns = re.findall(r"^\s{4}(\w+) ", ch.DDL_FILE.read_text(), re.M)
    assert sorted(row) == sorted(columns)
    assert row["time_s"] == pytest.approx(1_790_000_000.0) and row["time"] == 1_790_000_000
    assert row["stream"] in (0, 1) and row["slots_value"] == 2
    assert row["tokens_cache_read"] == rec["tokens"]["cache_read"] == 1024
    assert json.loads(row["prompt_json"]) == rec["prompt"]
    assert ch.flat_row({**rec, "time": "not a time"}) is None


def test_names_and_values_reach_sql_quoted_or_refused() -> None:
    for bad in ("x; DROP TABLE t", "1abc", "a.b.c", ""):
        with pytest.raises(ConfigError, match="ClickHouse table"):
            ch.table_name(bad)
    sql = chread.select("db.t", route="it's\\x", versions=("v1", "v'2"), start=10.5, end=20.0)
    assert "route = 'it\\'s\\\\x'" in sql and "IN ('v1', 'v\\'2')" in sql
    assert (
        "time_s >= 10.5" in sql
        and "time_s <= 20.0" in sql
        and sql.endswith("ORDER BY time_s, trace_id FORMAT TabSeparated")
    )


def test_clickhouse_settings(tmp_path: Path) -> None:
    base = {"upstream": "http://127.0.0.1:9"}
    assert build(base, env={}).record.clickhouse is None
    secret = tmp_path / "password"
    secret.write_text("from-file\n")
    env = {
        "LLMTAP_RECORD_CLICKHOUSE": "http://ch:8123",
        "LLMTAP_RECORD_CLICKHOUSE_USER": "writer",
        "LLMTAP_RECORD_CLICKHOUSE_PASSWORD_FILE": str(secret),
        "LLMTAP_RECORD_CLICKHOUSE_QUEUE": "10",
    }
    got = build(base, env=env).record.clickhouse
    assert got is not None
    assert (got.url, got.table, got.user, got.password, got.max_records, got.ttl_days) == (
        "http://ch:8123",
        "llmtap_records",
        "writer",
        "from-file",
        10,
        30,
    )
    assert "from-file" not in repr(got)
    assert build(base, env={**env, "LLMTAP_RECORD_CLICKHOUSE_PASSWORD": "env"}).record.clickhouse.password == "env"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="record_clickhouse_table"):
        build(base | {"record_clickhouse": "http://ch:8123", "record_clickhouse_table": "a;b"}, env={})
    with pytest.raises(ConfigError, match="password_file"):
        build(base | {"record_clickhouse": "http://ch:8123", "record_clickhouse_password_file": "/nope/x"}, env={})
    with pytest.raises(ConfigError):
        build(base | {"record_clickhouse": "ftp://ch"}, env={})


def test_the_sink_never_blocks_and_counts_what_it_drops_when_clickhouse_is_away() -> None:
    drops: dict[str, int] = {}
    inserts: dict[str, int] = {}
    sink = ClickHouseSink(
        ch.Server.parse(f"http://127.0.0.1:{free_port()}/"),
        "t",
        max_records=5,
        on_drop=lambda r, n: drops.__setitem__(r, drops.get(r, 0) + n),
        on_insert=lambda o, n: inserts.__setitem__(o, inserts.get(o, 0) + n),
        backoff=(0.05, 0.2),
    )
    records = make_records(12)
    for rec in records:
        sink.write(rec)
    sink.flush()
    assert sink.queued == 5 and drops == {"clickhouse_queue_full": 7}
    wait_for("a failed insert", lambda: inserts.get("failed", 0) >= 2, PATIENCE)
    sink.write({"time": "yesterday-ish", "ttft": 0.1})  # no moment to file it under
    assert drops["invalid"] == 1
    sink.write({"time": datetime.now(UTC).isoformat(), "ttft": float("nan")})  # NaN reads as null, as anywhere
    assert drops["clickhouse_queue_full"] == 8
    sink.close(timeout=0.5)
    assert drops["clickhouse_unsent"] == 5 and sink.written == 0 and inserts.get("ok", 0) == 0


# -- the real server and chDB ----------------------------------------------------------------------


def test_the_table_runs_on_debians_clickhouse_and_says_it_has_no_ttl(
    server: ClickHouseProcess, caplog: pytest.LogCaptureFixture
) -> None:
    remote = ch.Server.parse(server.url)
    release = remote.version()
    with caplog.at_level(logging.WARNING, "llmtap.telemetry"):
        said = ch.create_table(remote, "ddl_check", ttl_days=7)
        assert ch.create_table(remote, "ddl_check", ttl_days=7) == said  # IF NOT EXISTS: a second start is fine
    shown = server.query("SHOW CREATE TABLE ddl_check")
    assert "PARTITION BY toDate(time)" in shown and "ORDER BY (route, prompt_version, time, record_id)" in shown
    if release < ch.TTL_SINCE:
        assert "no TTL" in said and "TTL" not in shown
        assert "has no TTL (since 19.6)" in caplog.text and "the 7-day TTL is not applied" in caplog.text
    else:
        assert "rows kept 7 days" in said and "TTL time + toIntervalDay(7)" in shown


class Chdb:
    """chDB (a current ClickHouse, embedded) behind ``Server``'s two methods."""

    def __init__(self, path: Path) -> None:
        from chdb import session

        self.url = f"chdb:{path}"
        self.session = session.Session(str(path))  # type: ignore[no-untyped-call]

    def query(self, sql: str, body: bytes = b"", settings: dict[str, Any] | None = None) -> bytes:
        prefix = "".join(f"SET {k} = {v};\n" for k, v in (settings or {}).items())
        if body:
            sql = f"{sql} {body.decode()}"
        fmt = "TabSeparated" if not re.search(r"FORMAT \w+\s*$", sql) else "CSV"
        try:
            return bytes(self.session.query(prefix + sql, fmt).bytes())  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise ch.ClickHouseError(str(exc), reachable=True) from None

    def version(self) -> tuple[int, int]:
        major, minor = self.query("SELECT version()").decode().strip().split(".")[:2]
        return int(major), int(minor)


@pytest.fixture(scope="module")
def chdb_server(tmp_path_factory: pytest.TempPathFactory) -> Chdb:
    """One for the module: chDB runs one embedded server per process, at one path."""
    try:
        import chdb  # noqa: F401
    except ImportError:
        require_real(False, "chDB (a current ClickHouse, embedded)", "pip install chdb (the test extra)")
    return Chdb(tmp_path_factory.mktemp("chdb"))


def test_the_table_and_the_query_run_on_a_current_clickhouse(chdb_server: Chdb, server: ClickHouseProcess) -> None:
    release = chdb_server.version()
    assert release >= (24, 0)
    said = ch.create_table(chdb_server, "records", ttl_days=30)  # type: ignore[arg-type]
    assert said == "table records ready; rows kept 30 days"
    shown = chdb_server.query("SHOW CREATE TABLE records FORMAT TSVRaw").decode()
    assert "TTL time + toIntervalDay(30)" in shown and "ORDER BY (route, prompt_version, time, record_id)" in shown
    records = make_records(40)
    body = b"".join(json.dumps(ch.flat_row(r)).encode() + b"\n" for r in records)
    # A table whose TTL has passed for these records drops them as they come: the comparison needs none.
    ch.create_table(chdb_server, "dialects", ttl_days=0)  # type: ignore[arg-type]
    chdb_server.query("INSERT INTO dialects FORMAT JSONEachRow", body)
    # The same rows in Debian's 18.16 and the same SELECT: both dialects give the same flat columns.
    remote = ch.Server.parse(server.url)
    ch.create_table(remote, "dialects", ttl_days=0)
    remote.query("INSERT INTO dialects FORMAT JSONEachRow", body)
    where: dict[str, Any] = {"route": "chat", "versions": ("v1", "v2")}
    where |= {"start": 1_790_000_003.0, "end": 1_790_000_020.0}
    current = list(chread.parse_rows(chdb_server.query(chread.select("dialects", **where))))
    old = chread.query(remote, "dialects", **where)
    expected = [
        r
        for r in records
        if r["route"] == "chat" and 1_790_000_003.0 <= ch.flat_row(r)["time_s"] <= 1_790_000_020.0  # type: ignore[index]
    ]
    assert len(expected) >= 5
    assert current == old
    assert [r["trace_id"] for r in current] == [r["trace_id"] for r in expected]
    first = current[0]
    rec = expected[0]
    assert (first["ttft"], first["input_tokens"], first["cache_class"], first["obj_ttft"], first["instance_id"]) == (
        rec["ttft"],
        1200,
        rec["cache"]["class"],
        0.5,
        rec["instance_id"],
    )


def test_compare_and_slo_read_the_same_verdicts_from_clickhouse_as_from_the_file(
    server: ClickHouseProcess, tmp_path: Path
) -> None:
    records = make_records(400)
    path = tmp_path / "records.jsonl"
    lines: list[str] = []
    sink = ClickHouseSink(ch.Server.parse(server.url, user=USER, password=PASSWORD), "same_verdicts")
    for rec in records:
        lines.append(json.dumps(rec) + "\n")
        sink.write(rec)
    path.write_text("".join(lines), encoding="utf-8")  # a record file as an earlier llmtap wrote it
    assert sink.drain(PATIENCE)
    sink.close()
    assert sink.written == 400 and server.count("same_verdicts") == 400
    env = {"LLMTAP_RECORD_CLICKHOUSE_USER": USER, "LLMTAP_RECORD_CLICKHOUSE_PASSWORD": PASSWORD}
    source = ["--clickhouse", server.url, "--clickhouse-table", "same_verdicts"]
    for command in (
        ["compare", "--json", "--resamples", "200"],
        ["compare", "--json", "--resamples", "200", "--before", "v1", "--after", "v2", "--route", "chat"],
        ["compare", "--json", "--resamples", "200", "--split-at", "2026-09-21T14:15:00Z", "--window", "60s"],
        ["slo", "--json", "--resamples", "200"],
        [
            "slo",
            "--json",
            "--resamples",
            "200",
            "--shape",
            "long",
            "--until",
            "2026-09-21T14:16:00Z",
            "--window",
            "90s",
        ],
    ):
        code_file, from_file = _run([*command, str(path)])
        code_ch, from_ch = _run([*command, *source], env)
        assert code_file == code_ch == 0
        a, b = json.loads(from_file), json.loads(from_ch)
        assert a.pop("source").endswith("records)") and "ClickHouse" in b.pop("source")
        # Lines of a file that are not records: ClickHouse holds only rows.
        assert set(a.pop("skipped", {}).values()) <= {0} and b.pop("skipped", {}) == {}
        assert a == b, command
        if command[0] == "compare":
            assert a["before"]["requests"] > 10 and a["after"]["requests"] > 10
        else:
            assert a["verdicts"], a
    _, text = _run(["compare", *source], env)
    assert "caching gain" in text


def _run_both(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def test_clickhouse_compares_like_with_like_as_the_file_does(server: ClickHouseProcess, tmp_path: Path) -> None:
    """Issue 30's cases read from ClickHouse: a moved mix (no pooled verdict), the slowest requests by trace id,
    an unknown version answered with the known ones, and slo's slowest past its limit: as from the file."""
    from tests.analysis.test_compare import mix_records

    records = mix_records()
    for rec in records:
        rec["objective"] = {"shape": None, "percentile": 0.9, "ttft": 0.1}
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    sink = ClickHouseSink(ch.Server.parse(server.url), "like_with_like", ttl_days=0)
    for rec in records:
        sink.write(rec)
    sink.close(PATIENCE)
    assert sink.written == len(records), sink.dropped
    source = ["--clickhouse", server.url, "--clickhouse-table", "like_with_like"]
    for command in (
        ["compare", "--json", "--resamples", "200", "--split-at", "2026-05-01T12:15:00Z"],
        ["slo", "--json", "--resamples", "200"],
    ):
        code_file, from_file, _ = _run_both([*command, str(path)])
        code_ch, from_ch, _ = _run_both([*command, *source])
        assert code_file == code_ch == 0
        a, b = json.loads(from_file), json.loads(from_ch)
        a.pop("source"), b.pop("source"), a.pop("skipped", None), b.pop("skipped", None)
        assert a == b, command
        if command[0] == "compare":
            assert a["kind"] == "mix_moved" and len(a["strata"]) == 2 and a["after"]["slowest"][0]["trace_id"]
        else:
            past = [s for v in a["verdicts"] for s in v["slowest"]]
            assert len(past) == 5 and all(ttft > 0.1 and len(trace) == 32 for ttft, trace in past), past
    unknown = ["compare", "--before", "v1", "--after", "v3"]
    code_file, _, err_file = _run_both([*unknown, str(path)])
    code_ch, _, err_ch = _run_both([*unknown, *source])
    assert code_file == code_ch == 2 and err_file == err_ch
    assert "no requests of prompt version v3; versions seen: v2 (36 requests), v1 (24 requests)" in err_ch


# -- a real proxy ----------------------------------------------------------------------------------


@pytest.fixture
def sim() -> Iterator[str]:
    url, stop = run_in_thread(get_profile("fast"))
    yield url
    stop()


class Serve:
    """``llmtap serve`` in a child process, in front of the simulator."""

    def __init__(self, sim: str, *flags: str, env: dict[str, str] | None = None) -> None:
        self.port, self.admin = free_port(), free_port()
        cmd = [sys.executable, "-m", "llmtap", "serve", "--upstream", sim, "--provider", "llmtap-sim"]
        cmd += ["--port", str(self.port), "--admin-port", str(self.admin), *flags]
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMTAP_"))}
        full_env = {**base, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=full_env)
        deadline = time.monotonic() + PATIENCE
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{self.admin}/readyz", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline and self.proc.poll() is None, "the proxy did not start"
            time.sleep(0.05)

    def ask(self, version: str) -> httpx.Response:
        body = {"model": "llmtap-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        return httpx.post(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            json=body,
            headers={"x-llmtap-prompt-version": version},
            timeout=PATIENCE,
        )

    def metric(self, name: str, label: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.admin}/metrics", timeout=PATIENCE).text
        match = re.search(rf"^{name}\{{[^}}]*{re.escape(label)}[^}}]*\}} (\S+)$", text, re.M)
        return float(match.group(1)) if match else -1.0

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=PATIENCE)
        assert self.proc.returncode == 0, err
        return err.decode(errors="replace")


INSERTS = "llmtap_telemetry_clickhouse_inserts_total"
DROPPED = "llmtap_telemetry_records_dropped_total"


@pytest.mark.e2e
def test_the_proxys_records_land_in_clickhouse(server: ClickHouseProcess, sim: str) -> None:
    serve = Serve(
        sim,
        "--record-clickhouse",
        server.url,
        "--record-clickhouse-table",
        "from_proxy",
        env={"LLMTAP_RECORD_CLICKHOUSE_USER": USER, "LLMTAP_RECORD_CLICKHOUSE_PASSWORD": PASSWORD},
    )
    try:
        for version in ("v1", "v1", "v2"):
            assert serve.ask(version).is_success
        wait_for("3 rows in ClickHouse", lambda: _table_count(server, "from_proxy") == 3, PATIENCE)
        assert serve.metric(INSERTS, 'outcome="ok"') >= 1
        assert serve.metric(INSERTS, 'outcome="failed"') == 0
        assert serve.metric(DROPPED, 'reason="clickhouse_queue_full"') == 0
    finally:
        serve.stop()
    rows = server.query(
        "SELECT prompt_version, route, length(trace_id), ttft > 0, stream, outcome, tokens_output > 0 "
        "FROM from_proxy ORDER BY time_s FORMAT TSV"
    ).splitlines()
    assert [r.split("\t") for r in rows] == [[v, "default", "32", "1", "1", "ok", "1"] for v in ("v1", "v1", "v2")], (
        rows
    )


@pytest.mark.e2e
def test_clickhouse_down_the_proxy_serves_counts_its_drops_and_catches_up(sim: str, tmp_path: Path) -> None:
    require_real(installed(), "ClickHouse (clickhouse-server)", HOW)
    later = ClickHouseProcess(tmp_path / "later")  # its ports chosen, nothing listening yet
    serve = Serve(sim, "--record-clickhouse", later.url, "--record-clickhouse-queue", "3")
    try:
        began = time.monotonic()
        for _ in range(6):
            r = serve.ask("v1")
            assert r.is_success and "data: [DONE]" in r.text
        wait_for("a failed insert on /metrics", lambda: serve.metric(INSERTS, 'outcome="failed"') >= 1, PATIENCE)
        wait_for("3 drops on /metrics", lambda: serve.metric(DROPPED, 'reason="clickhouse_queue_full"') == 3, PATIENCE)
        assert time.monotonic() - began < PATIENCE
        later.start(PATIENCE)
        try:
            # The three queued records arrive once ClickHouse is back; later ones follow.
            wait_for("the queued records", lambda: _table_count(later, "llmtap_records") == 3, PATIENCE)
            assert serve.ask("v2").is_success
            wait_for("the next record", lambda: _table_count(later, "llmtap_records") == 4, PATIENCE)
            assert serve.metric(INSERTS, 'outcome="ok"') >= 2
            assert serve.metric(DROPPED, 'reason="clickhouse_queue_full"') == 3
        finally:
            err = serve.stop()
            later.stop()
    except BaseException:
        if serve.proc.poll() is None:
            serve.proc.kill()
        raise
    assert "cannot write to" in err and "takes records again" in err


def _table_count(proc: ClickHouseProcess, table: str) -> int:
    try:
        return proc.count(table)
    except OSError:  # the table is not there yet
        return -1


@pytest.mark.parametrize("numpy", ["installed", "absent"])
def test_the_clickhouse_source_gives_the_reference_sources_facts(
    server: ClickHouseProcess, tmp_path: Path, numpy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With numpy and without it (the analysis extra is not installed): the source parses the sorted values
    ClickHouse sends either way, to the same floats."""
    from llmtap.store import VERSION, Filter
    from llmtap.store.python import PythonSource

    if numpy == "absent":
        monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` raises ImportError
    table = f"source_check_{numpy}"

    records = make_records(300, seed=11)
    # Nulls and odd values where the reference has rules for them: no route or shape, a wrong-typed figure,
    # no objective, a tie of two objectives at one moment (the greater wins), no cache class or prefill source.
    records[3]["route"] = None
    records[4]["shape"] = None
    records[5]["ttft"] = "fast"
    records[6]["objective"] = None
    records[-1]["objective"] = {"shape": "long", "percentile": 0.99, "ttft": 0.2}
    records[-2]["time"] = records[-1]["time"]
    records[-2]["objective"] = {"shape": "long", "percentile": 0.9, "ttft": 9.0}
    records[-2]["route"], records[-2]["shape"] = records[-1]["route"], records[-1]["shape"]
    records[7]["cache"] = None
    records[8]["prefill_source"] = None
    # Costs: priced (amounts exact in binary, so any order of summing agrees), unknown, wrong-typed.
    for i, rec in enumerate(records):
        amount = (i % 50) / 2**20 if i % 4 else None
        rec["cost"] = {"amount": amount, "currency": "USD", "status": "priced" if amount is not None else "unknown"}
    records[10]["cost"] = {"amount": "cheap"}
    # The requests' own objectives (x-slo-*): outcomes of both figures, one missing, one no outcome llmtap writes.
    outcomes = ("met", "violated", None, "met", "unknown")
    for i, rec in enumerate(records):
        if i % 3:
            ttft, tpot = outcomes[i % 5], outcomes[(i // 5) % 4]
            rec["request_objective"] = {"ttft": 0.5, "tpot": 0.05, "ttft_outcome": ttft, "tpot_outcome": tpot}
    path = tmp_path / "records.jsonl"
    lines: list[str] = []
    sink = ClickHouseSink(ch.Server.parse(server.url), table, ttl_days=0)
    for rec in records:
        lines.append(json.dumps(rec) + "\n")
        sink.write(rec)
    path.write_text("".join(lines), encoding="utf-8")  # a record file as an earlier llmtap wrote it
    sink.close(PATIENCE)
    assert sink.written == 300, sink.dropped
    reference = PythonSource([path])
    source = chread.ClickHouseSource(ch.Server.parse(server.url), table)

    def keyed(groups: list[Any]) -> dict[tuple[str, str, str], Any]:
        return {(str(g.key), str(g.route), str(g.shape)): g for g in groups}

    middle = 1_790_000_000.0 + 150 * 0.75
    limits = {("chat", "short"): {"ttft": 0.4, "tpot": 0.05}, ("code", "long"): {"e2e": 2.0}}
    for where in (Filter(), Filter(route="chat"), Filter(start=1_790_000_030.0, end=middle, open_end=True)):
        for by in (VERSION, middle, None):
            want, got = reference.scan(where, by), source.scan(where, by)
            assert len(want.groups) >= 2
            assert keyed(got.groups) == keyed(want.groups), (where, by)
            assert got.records == 300
            assert source.count_met(where, by, limits) == reference.count_met(where, by, limits)
    violated = [g.request_objectives.get("ttft", {}).get("violated", 0) for g in reference.scan(Filter(), None).groups]
    assert sum(violated) > 10  # the counts compared above are there
    tied = [g for g in reference.scan(Filter(), None).groups if g.objective and g.objective.percentile == 0.99]
    assert len(tied) == 1  # the tie is in the data, and both sources broke it the same way


@pytest.mark.parametrize("made", ["now", "earlier"])
def test_a_record_inserted_twice_counts_once_on_either_clickhouse(
    made: str, server: ClickHouseProcess, chdb_server: Chdb, tmp_path: Path
) -> None:
    """A journal's replay sends records again: every record twice and some three times, into a table
    made now (one row per record once merged) and into one of an earlier version (a MergeTree without the newest
    columns, read as it is), on Debian's 18.16 and on a current ClickHouse: the same facts as the file read once."""
    from llmtap.store import VERSION, Filter
    from llmtap.store.python import PythonSource

    records = make_records(240, seed=5)
    records[0]["trace_id"], records[0]["span_id"] = "f" * 32, "f" * 16  # make_records' first ids are zeros
    records[7]["trace_id"] = records[7]["span_id"] = None  # no ids: counted as it is, each time it comes
    records[8]["trace_id"], records[8]["span_id"] = "0" * 32, "0" * 16  # W3C's invalid ids: the same
    once = tmp_path / "once.jsonl"  # each record once, those without ids three times
    once.write_text("".join(json.dumps(r) + "\n" for r in records + records[7:9] * 2), encoding="utf-8")
    sent = records + records + records[100:150] + records[7:9]
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join(json.dumps(r) + "\n" for r in sent), encoding="utf-8")
    reference = PythonSource([twice])
    want = reference.scan(Filter(), VERSION)
    assert want.skipped == {"duplicate": 288} and want.records == 244
    for remote in (ch.Server.parse(server.url), chdb_server):
        table = f"twice_{made}"
        if made == "now":
            ch.create_table(remote, table, ttl_days=0)  # type: ignore[arg-type]
        else:
            earlier_table(remote, table)  # type: ignore[arg-type]
        rows = [ch.flat_row(r) for r in sent]
        body = b"".join(json.dumps(row).encode() + b"\n" for row in rows)
        remote.query(f"INSERT INTO {table} FORMAT JSONEachRow", body, settings={"input_format_skip_unknown_fields": 1})
        source = chread.ClickHouseSource(remote, table)  # type: ignore[arg-type]
        for where, by in ((Filter(), VERSION), (Filter(route="chat"), None)):
            got, expected = source.scan(where, by), reference.scan(where, by)
            assert {(g.key, g.route, g.shape): g for g in got.groups} == {
                (g.key, g.route, g.shape): g for g in expected.groups
            }
            assert got.records == 244
            # A table made now may have merged some copies (a current ClickHouse does within one INSERT) by then.
            skipped = got.skipped
            copies = skipped.pop("duplicate", 0)
            assert skipped == {} and (copies == 288 if made == "earlier" else 0 <= copies <= 288)
        limits = {("chat", "short"): {"ttft": 0.4}, ("code", "long"): {"e2e": 2.0}}
        assert source.count_met(Filter(), VERSION, limits) == reference.count_met(Filter(), VERSION, limits)
        if made == "now":  # once merged, one row per record (those without ids as they came)
            remote.query(f"OPTIMIZE TABLE {table} FINAL")
            assert int(remote.query(f"SELECT count() FROM {table}").decode()) == 244
            assert chread.ClickHouseSource(remote, table).scan(Filter(), VERSION).skipped == {}  # type: ignore[arg-type]
    split = Split(before="v1", after="v2")
    a = compare.record_sides([once], split, engine="python").compare(seed=1, resamples=200).to_json()
    b = compare.record_sides([twice], split, engine="duckdb").compare(seed=1, resamples=200).to_json()
    assert a.pop("source") != b.pop("source") and b.pop("skipped") == {"duplicate": 288} and a.pop("skipped") == {}
    assert a["before"]["requests"] + a["after"]["requests"] == 244 and a == b


@pytest.mark.parametrize("made", ["now", "earlier"])
def test_records_without_tracing_inserted_twice_count_once_by_their_record_id(
    made: str, server: ClickHouseProcess, chdb_server: Chdb, tmp_path: Path
) -> None:
    """Tracing off, every record's trace and span ids are zeros: its record_id is what the table keeps one row of
    and what the source counts once, on Debian's 18.16 and a current ClickHouse, in a table made now and in one of
    an earlier version that got the record_id column at start (its rows from before hold none and are read by their
    trace and span ids, as they were)."""
    from llmtap.store import VERSION, Filter
    from llmtap.store.python import PythonSource

    records = make_records(120, seed=8)
    for i, rec in enumerate(records):
        rec["trace_id"], rec["span_id"], rec["record_id"] = "0" * 32, "0" * 16, f"{i + 1:032x}"
    before = make_records(10, seed=9, start=1_789_000_000.0)  # traced records of an older version, no record_id
    before[0]["trace_id"], before[0]["span_id"] = "f" * 32, "f" * 16  # make_records' first ids are zeros
    sent = records + records[:50] + records[100:]
    once, twice = tmp_path / "once.jsonl", tmp_path / "twice.jsonl"
    once.write_text("".join(json.dumps(r) + "\n" for r in before + records), encoding="utf-8")
    twice.write_text("".join(json.dumps(r) + "\n" for r in before + sent + before[:4]), encoding="utf-8")
    reference = PythonSource([twice])
    want = reference.scan(Filter(), VERSION)
    assert want.skipped == {"duplicate": 74} and want.records == 130
    assert want.groups == PythonSource([once]).scan(Filter(), VERSION).groups
    for remote in (ch.Server.parse(server.url), chdb_server):
        table = f"untraced_{made}"
        if made == "now":
            ch.create_table(remote, table, ttl_days=0)  # type: ignore[arg-type]
        else:
            earlier_table(remote, table)  # type: ignore[arg-type]
        settings = {"input_format_skip_unknown_fields": 1}
        rows = b"".join(json.dumps(ch.flat_row(r)).encode() + b"\n" for r in before)
        remote.query(f"INSERT INTO {table} FORMAT JSONEachRow", rows, settings=settings)
        if made == "earlier":
            assert "record_id" in ch.add_missing_columns(remote, table)  # type: ignore[arg-type]
        rows = b"".join(json.dumps(ch.flat_row(r)).encode() + b"\n" for r in sent + before[:4])
        remote.query(f"INSERT INTO {table} FORMAT JSONEachRow", rows, settings=settings)
        source = chread.ClickHouseSource(remote, table)  # type: ignore[arg-type]
        got = source.scan(Filter(), VERSION)
        assert got.records == 130
        assert {(g.key, g.route, g.shape): g for g in got.groups} == {(g.key, g.route, g.shape): g for g in want.groups}
        skipped = got.skipped
        copies = skipped.pop("duplicate", 0)
        # A table made now may have merged some copies (a current ClickHouse does within one INSERT) by then.
        assert skipped == {} and (copies == 74 if made == "earlier" else 0 <= copies <= 74)
        if made == "now":  # once merged, one row per record
            remote.query(f"OPTIMIZE TABLE {table} FINAL")
            assert int(remote.query(f"SELECT count() FROM {table}").decode()) == 130


#: The columns each version of the table added, oldest first: cost, the requests' own objectives and the
#: record id, then
#: the first tokens, the cost's source and currency, the 1-hour cache writes and the attribution.
ADDED = {
    "cost": [
        "cost_amount",
        "cost_status",
        "request_ttft",
        "request_tpot",
        "request_ttft_outcome",
        "request_tpot_outcome",
        "record_id",
    ],
    "first_tokens": [
        "ttfot",
        "ttst",
        "objective_ttfot",
        "objective_ttst",
        "upstream_unattributed",
        "tokens_cache_write_1h",
        "cost_currency",
        "cost_source",
        "cost_prices",
        "attribution_json",
    ],
}


def added_since(version: str) -> list[str]:
    """The columns added by the versions after ``version`` ('' for the first table)."""
    names = list(ADDED)
    return [c for v in names[names.index(version) + 1 if version else 0 :] for c in ADDED[v]]


def previous_table(remote: ch.Server, table: str) -> None:
    """The table as the version before the first-token columns made it: with record_id, without those."""
    old = "\n".join(
        line for line in ch.ddl(table).splitlines() if line.strip().split(" ")[0] not in added_since("cost")
    )
    _create(remote, old.replace("record_id String,", "record_id String"))


def _create(remote: ch.Server, sql: str) -> None:
    try:
        remote.query(sql)
    except ch.ClickHouseError as exc:  # ClickHouse before 19 wants LowCardinality asked for (as create_table does)
        assert "allow_experimental_low_cardinality_type" in str(exc)
        remote.query(sql, settings={"allow_experimental_low_cardinality_type": 1})


def earlier_table(remote: ch.Server, table: str) -> None:
    """The table as llmtap made it before the cost columns, before one row per record and
    before the requests' own objectives: a MergeTree without any column added since (``ADDED``)."""
    old = "\n".join(line for line in ch.ddl(table).splitlines() if line.strip().split(" ")[0] not in added_since(""))
    old = old.replace("cache_min_tokens Nullable(Int64),", "cache_min_tokens Nullable(Int64)")
    old = old.replace("ReplacingMergeTree", "MergeTree").replace(", record_id)", ")")
    _create(remote, old)


def test_a_table_of_an_earlier_version_gets_the_columns_added_since(server: ClickHouseProcess) -> None:
    """A table made before the cost columns and the record id gets them at start; its older
    rows read null there, and a new record's cost lands in them."""
    remote = ch.Server.parse(server.url)
    table = "before_cost"
    earlier_table(remote, table)
    assert "cost_amount" not in remote.query(f"DESCRIBE TABLE {table}").decode()
    assert ch.add_missing_columns(remote, table) == added_since("")
    assert ch.add_missing_columns(remote, table) == []
    record = make_records(1, seed=3)[0]
    record["cost"] = {"amount": 0.25, "currency": "USD", "status": "priced", "prices": "file"}
    sink = ClickHouseSink(remote, table, ttl_days=0)
    sink.write(record)
    sink.close(PATIENCE)
    assert sink.written == 1, sink.dropped
    assert remote.query(f"SELECT cost_amount, cost_status FROM {table}").decode() == "0.25\tpriced\n"


def first_token_records(n: int) -> list[dict[str, Any]]:
    """``make_records`` with what a reasoning model's records carry: every third stream reasons first (TTFOT past
    TTFT), every fifth is one chunk (no TTST); objectives on both; a provider's cost, 1-hour cache writes and an
    attribution."""
    records = make_records(n, seed=5)
    for i, rec in enumerate(records):
        ttft = rec["ttft"]
        rec["ttfot"] = None if ttft is None else round(ttft + 0.4, 6) if i % 3 == 0 else ttft
        rec["ttst"] = None if ttft is None or i % 5 == 0 else round(0.015 + (i % 9) / 1000, 6)
        rec["objective"] = {**rec["objective"], "ttfot": 0.7, "ttst": 0.02}
        rec["upstream_unattributed"] = 0.003
        rec["tokens"]["cache_write_1h"] = 2048 if i % 2 else None
        rec["cost"] = {"amount": i / 2**16, "currency": "USD", "status": "priced", "prices": None, "source": "provider"}
        rec["attribution"] = {"tenant": "acme", "properties": {"feature": "chat"}}
    return records


def test_first_tokens_and_the_costs_source_land_in_columns_of_a_new_table_and_a_previous_ones(
    server: ClickHouseProcess, tmp_path: Path
) -> None:
    """TTFOT, TTST, their objectives, the cost's source and currency, 1-hour cache writes, the unattributed time and
    the attribution reach columns of their own, in a new table and in one a previous version made (which gains
    them at start, its older rows null there); ``compare`` and ``slo`` read TTFOT and TTST from ClickHouse as from
    the record file."""
    from llmtap.store import Filter
    from llmtap.store.python import PythonSource

    remote = ch.Server.parse(server.url)
    previous_table(remote, "before_first_tokens")
    old = make_records(1, seed=9)[0]
    old["trace_id"] = "f" * 32  # apart from the records written after
    flat = ch.flat_row(old)
    assert flat is not None
    kept = {k: v for k, v in flat.items() if k not in added_since("cost")}
    remote.query("INSERT INTO before_first_tokens FORMAT JSONEachRow", (json.dumps(kept) + "\n").encode())
    records = first_token_records(300)
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    for table in ("first_tokens", "before_first_tokens"):
        sink = ClickHouseSink(remote, table, ttl_days=0)
        for rec in records:
            sink.write(rec)
        sink.close(PATIENCE)
        assert sink.written == 300, sink.dropped
        described = remote.query(f"DESCRIBE TABLE {table}").decode()
        assert all(f"\n{name}\t" in "\n" + described for name in added_since("cost")), described
    rid = ch.record_id(records[3])
    row = remote.query(
        "SELECT ttfot, ttst, objective_ttfot, objective_ttst, cost_source, cost_currency, tokens_cache_write_1h, "
        f"upstream_unattributed, attribution_json FROM first_tokens WHERE record_id = '{rid}' FORMAT JSONEachRow"
    )
    got = json.loads(row)
    want = records[3]
    assert (got["ttfot"], got["ttst"]) == (want["ttfot"], want["ttst"]) and want["ttst"] is not None
    assert want["ttfot"] > want["ttft"]  # the third record reasons first
    assert (got["objective_ttfot"], got["objective_ttst"]) == (0.7, 0.02)
    # An Int64 reads as a string in JSON (ClickHouse quotes 64-bit integers by default).
    assert (got["cost_source"], got["cost_currency"], int(got["tokens_cache_write_1h"])) == ("provider", "USD", 2048)
    assert got["upstream_unattributed"] == 0.003
    assert json.loads(got["attribution_json"]) == {"tenant": "acme", "properties": {"feature": "chat"}}
    one_chunk = remote.query("SELECT count() FROM first_tokens WHERE stream = 1 AND ttst IS NULL").decode()
    assert int(one_chunk) == sum(1 for r in records if r["stream"] and r["ttst"] is None) > 0
    # The previous table's older row reads null in the new columns.
    nulls = remote.query(
        f"SELECT ttfot, cost_source FROM before_first_tokens WHERE trace_id = '{old['trace_id']}' FORMAT TabSeparated"
    )
    assert nulls.decode() == "\\N\t\\N\n"

    # The source's facts are the reference's, TTFOT and TTST included.
    reference = PythonSource([path]).scan(Filter(), None)
    facts = chread.ClickHouseSource(remote, "first_tokens").scan(Filter(), None)
    by_key = {(g.route, g.shape): g for g in reference.groups}
    assert facts.groups and all(
        (list(g.ttfot), list(g.ttst)) == (list(by_key[(g.route, g.shape)].ttfot), list(by_key[(g.route, g.shape)].ttst))
        for g in facts.groups
    )
    assert all(len(g.ttfot) > len(g.ttst) > 0 for g in facts.groups)
    env = {"LLMTAP_RECORD_CLICKHOUSE_USER": USER, "LLMTAP_RECORD_CLICKHOUSE_PASSWORD": PASSWORD}
    source = ["--clickhouse", server.url, "--clickhouse-table", "first_tokens"]
    for command in (["compare", "--json", "--resamples", "200"], ["slo", "--json", "--resamples", "200"]):
        code_file, from_file = _run([*command, str(path)])
        code_ch, from_ch = _run([*command, *source], env)
        a, b = json.loads(from_file), json.loads(from_ch)
        assert a.pop("source").endswith("records)") and "ClickHouse" in b.pop("source")
        a.pop("skipped", None), b.pop("skipped", None)
        assert a == b and code_file == code_ch, command
        if command[0] == "compare":
            assert a["before"]["ttfot_requests"] > a["before"]["ttst_requests"] > 10
            assert a["before"]["ttfot"]["p95"]["value"] > a["before"]["ttft"]["p95"]["value"]
        else:
            figures = {c["figure"] for v in a["verdicts"] for c in v["checks"]}
            assert {"ttfot", "ttst"} <= figures
