"""Request records: what a line holds (and never holds), rotation, flushing, bad lines, and the settings."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult

from llmtap import __version__ as proxy_version
from llmtap.analysis import tokens
from llmtap.config.load import build
from llmtap.config.types import ConfigError, Records, Route, Settings
from llmtap.simulator import get_profile, run_in_thread
from llmtap.store.files import ReadStats, read_records, record_files_at
from llmtap.telemetry.identity import Identity, current
from llmtap.telemetry.recorder import Recorder
from llmtap.telemetry.records.dataset import DatasetWriter
from llmtap.telemetry.records.logs import LogSink
from llmtap.telemetry.records.record import SCHEMA_KEY
from tests.conftest import PATIENCE, Telemetry, free_port
from tests.telemetry.test_recorder import timeline

ROOT = Path(__file__).resolve().parents[2]
CANARY_PROMPT = "canary-prompt-7f3a9"
CANARY_KEY = "sk-canary-key-0b41d"


@pytest.fixture
def sim() -> Iterator[str]:
    url, stop = run_in_thread(get_profile("fast"))
    yield url
    stop()


def records(path: Path) -> list[dict[str, Any]]:
    stats = ReadStats()
    out = list(read_records(path, stats))
    assert stats.skipped == 0, stats
    return out


@pytest.mark.e2e
def test_a_record_holds_the_figures_and_never_content_or_secrets(
    sim: str, proxy_factory: Any, telemetry: Telemetry, tmp_path: Path
) -> None:
    path = tmp_path / "rec" / "requests"
    route = Route(prefix="/", upstream=sim, name="sim", provider="llmtap-sim", prompt_version="from-config")
    proxy = proxy_factory(Settings(routes=(route,), record=Records(path=str(path))))
    prompt = f"Please remember {CANARY_PROMPT} for later." + " and then" * 40
    body = {"model": "llmtap-sim", "messages": [{"role": "user", "content": prompt}], "max_tokens": 5, "stream": True}
    secret = {"authorization": f"Bearer {CANARY_KEY}", "x-api-key": CANARY_KEY}
    with httpx.stream(
        "POST", proxy.url + "/v1/chat/completions", json=body, headers={**secret, "x-llmtap-prompt-version": "v7"}
    ) as r:
        assert r.status_code == 200
        r.read()
    assert httpx.post(proxy.url + "/v1/chat/completions", json=body | {"stream": False}, headers=secret).is_success
    bad = httpx.post(proxy.url + "/v1/chat/completions", json=body | {"model": f"no-{CANARY_PROMPT}"}, headers=secret)
    assert bad.status_code == 404 and CANARY_PROMPT in bad.text  # the server quoted it back
    proxy.flush()

    raw = b"".join(f.read_bytes() for f in record_files_at(path))
    assert CANARY_PROMPT.encode() not in raw.replace(b"no-" + CANARY_PROMPT.encode(), b"")
    assert CANARY_KEY.encode() not in raw and b"Bearer" not in raw
    streamed, whole, failed = records(path)
    # Each is a record as the published schema describes it, and the schema describes every field written.
    schema = json.loads((ROOT / "docs" / "record.schema.json").read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    for rec in (streamed, whole, failed):
        validator.validate(rec)
        # Fields added within schema 2 are optional (readers take records without them); every one is written.
        assert set(schema["required"]) <= set(rec) == set(schema["properties"])
    optional = set(schema["properties"]) - set(schema["required"])
    assert "upstream_unattributed" in optional
    validator.validate({k: v for k, v in streamed.items() if k not in optional})  # a record of an older version
    assert not validator.is_valid({**streamed, "pid": "12"})
    assert not validator.is_valid({**streamed, "upstream_unattributed": -1.0})
    # Real records through Parquet and back: the same records.
    parquet = DatasetWriter(tmp_path / "pq", current(), parquet=True)
    for rec in (streamed, whole, failed):
        parquet.write(rec)
    parquet.close()
    assert [f.suffix for f in record_files_at(tmp_path / "pq")] == [".parquet"]
    assert records(tmp_path / "pq") == [streamed, whole, failed]
    assert streamed[SCHEMA_KEY] == 2
    me = current()
    assert (streamed["instance_id"], streamed["host"], streamed["pid"]) == (me.instance_id, me.host, me.pid)
    assert streamed["llmtap_version"] == proxy_version
    assert len(streamed["span_id"]) == 16 and int(streamed["span_id"], 16)
    # The simulator's chat completion id, as its stream and its whole answer carried it.
    assert streamed["response_id"].startswith("chatcmpl-") and whole["response_id"].startswith("chatcmpl-")
    assert failed["response_id"] is None
    assert abs(datetime.fromisoformat(streamed["time"]).timestamp() - time.time()) < 60
    assert streamed["prompt_version"] == "v7" and whole["prompt_version"] == "from-config"
    assert (streamed["route"], streamed["model"], streamed["stream"], streamed["status"]) == (
        "sim",
        "llmtap-sim",
        True,
        200,
    )
    assert (streamed["outcome"], streamed["slo"], whole["stream"]) == ("ok", "none", False)
    for key in ("ttft", "ttfb", "upstream_ttft", "tpot", "e2e", "queue", "prefill", "decode"):
        assert isinstance(streamed[key], float) and streamed[key] >= 0, key
    assert streamed["ttfb"] <= streamed["ttft"] <= streamed["e2e"]
    # A non-streamed answer arrives whole: no TTFT (it said its whole duration), in its record, on its
    # span and in the time-to-first-chunk metrics; its E2E is its latency.
    assert whole["ttft"] is None and whole["upstream_ttft"] is None and whole["e2e"] > 0
    ttft_attr = "gen_ai.response.time_to_first_chunk"
    roots = {
        str(s.attributes.get("gen_ai.response.id")): s.attributes
        for s in telemetry.finished()
        if s.parent is None and s.attributes
    }
    assert ttft_attr in roots[streamed["response_id"]] and ttft_attr not in roots[whole["response_id"]]
    points = telemetry.metrics()
    for name in ("gen_ai.client.operation.time_to_first_chunk", "llmtap.time_to_first_token"):
        assert sum(p.count for p in points[name]) == 1, name  # the streamed request alone
    assert streamed["queue_source"] and streamed["prefill_source"]
    assert streamed["gaps"]["n"] == 4 and streamed["gaps"]["p50"] <= streamed["gaps"]["max"]
    assert streamed["tokens"] == {
        "input": tokens.count(prompt),
        "input_source": "usage",
        "output": 5,
        "output_source": "usage",
        "cache_read": 0,
        "cache_write": None,
        "cache_write_1h": None,
        "reasoning": None,
    }
    assert [r["name"] for r in streamed["prompt"]["regions"]] == ["m0"]
    assert streamed["prompt"]["regions"][0]["tokens"] == tokens.count(prompt)
    assert streamed["cache"]["class"] == "cold" and streamed["cache"]["min_tokens"] == 16
    assert whole["cache"]["expected_prefix_tokens"] > 0  # the same prompt, sent after the first one's prefill
    # An error keeps its type, never its message (servers quote prompts in messages).
    assert (failed["outcome"], failed["status"], failed["error_type"]) == ("error", 404, "NotFoundError")


ME = Identity(instance_id="host-1-abc", host="host", pid=1)


def test_files_rotate_by_size_and_time_into_hour_partitions_and_are_compressed(tmp_path: Path) -> None:
    clock = [1_700_001_600.0]  # 2023-11-14 22:40:00 UTC
    writer = DatasetWriter(tmp_path / "ds", ME, max_bytes=2000, rotate_s=120, clock=lambda: clock[0])
    for i in range(60):
        writer.write({SCHEMA_KEY: 2, "seq": i, "pad": "x" * 150})
        writer.flush()
        clock[0] += 30  # 30 minutes in all: many rotation intervals, and the hour turns
    writer.close()
    files = record_files_at(tmp_path / "ds")
    names = [f.relative_to(tmp_path / "ds").as_posix() for f in files]
    assert all(n.endswith(".jsonl.gz") and "-host-1-abc-" in n for n in names), names
    assert {n.split("/")[1] for n in names} == {"hour=22", "hour=23"}
    assert {n.split("/")[0] for n in names} == {"date=2023-11-14"}
    assert not list((tmp_path / "ds").rglob("*.jsonl")) and not list((tmp_path / "ds").rglob("*.part"))
    # Every file closed by size or by time: never more than 2000 bytes, never more than 120 s of writes.
    sizes = [len(gzip.decompress(f.read_bytes())) for f in files]
    assert all(0 < size <= 2000 for size in sizes), sizes
    assert len(files) >= 60 * 30 // 120
    assert [r["seq"] for r in records(tmp_path / "ds")] == list(range(60))
    # Idle, the open file is closed and compressed once its time is up, at the next flush with nothing to write.
    idle = DatasetWriter(tmp_path / "idle", ME, rotate_s=120, clock=lambda: clock[0])
    idle.write({SCHEMA_KEY: 2, "seq": 0})
    idle.flush()
    assert idle.path is not None and idle.path.name.endswith(".jsonl")
    clock[0] += 60
    idle.flush()
    assert idle.path.exists()
    clock[0] += 60
    idle.flush()
    idle._closer.stop(PATIENCE)  # the compression done
    assert [f.name.endswith(".jsonl.gz") for f in record_files_at(tmp_path / "idle")] == [True]
    idle.close()


def test_retention_keeps_the_newest_closed_files_within_the_bounds(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    writer = DatasetWriter(root, ME, max_bytes=1200, keep_bytes=3000)
    for i in range(200):
        writer.write({SCHEMA_KEY: 2, "seq": i, "pad": os.urandom(200).hex()})  # hex of random bytes: compresses ~2x
        writer.flush()
    writer.close()
    files = record_files_at(root)
    assert 0 < sum(f.stat().st_size for f in files) <= 3000 + 1200
    seqs = [r["seq"] for r in records(root)]
    assert seqs == list(range(200 - len(seqs), 200)) and 5 <= len(seqs) < 100, seqs  # the newest, in order
    # By age too: a closed file older than keep_s goes at the next rotation, whatever the bytes.
    old = files[0]
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    aged = DatasetWriter(root, ME, max_bytes=1200, keep_s=3600)
    for i in range(20):
        aged.write({SCHEMA_KEY: 2, "seq": 1000 + i, "pad": "z" * 200})
        aged.flush()
    aged.close()
    assert not old.exists() and files[-1].exists()


def test_a_file_moved_away_by_another_program_is_left_to_it(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    writer = DatasetWriter(root, ME)
    writer.write({SCHEMA_KEY: 2, "seq": 1})
    writer.flush()
    first = writer.path
    assert first is not None and first.name.endswith(".jsonl")
    moved = tmp_path / "rotated-by-logrotate.jsonl"
    first.rename(moved)  # what logrotate's default (create) mode does
    writer.write({SCHEMA_KEY: 2, "seq": 2})
    writer.flush()
    assert writer.path is not None and writer.path != first and writer.path.exists()
    first_again = writer.path
    first_again.unlink()  # removed outright
    writer.write({SCHEMA_KEY: 2, "seq": 3})
    writer.close()
    assert [r["seq"] for r in records(moved)] == [1]  # the moved file got nothing more
    assert [r["seq"] for r in records(root)] == [3]


def test_an_old_record_file_setting_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "old.yaml"
    config.write_text("upstream: http://u:1\nrecord: {path: /tmp/x, files: 3}\n")
    with pytest.raises(ConfigError, match=r"'record.files' was removed: .*record.keep_mb, record.keep_hours"):
        build({"config": str(config)}, env={})
    run = subprocess.run(
        [sys.executable, "-m", "llmtap", "serve", "--upstream", "http://u:1", "--record-files", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--record-files was removed" in run.stderr and "--record-keep-mb" in run.stderr
    old = tmp_path / "records.jsonl"
    old.write_text(json.dumps({SCHEMA_KEY: 1, "seq": 1}) + "\n")
    for path in (old, tmp_path / "new.jsonl"):
        with pytest.raises(ConfigError, match="--record now names a folder"):
            DatasetWriter(path, ME)
    # The old file itself stays readable, schema 1 beside schema 2.
    assert [r["seq"] for r in records(old)] == [1]


def test_lines_are_buffered_until_flush_or_close(tmp_path: Path) -> None:
    path = tmp_path / "r"
    settings = Settings(routes=(Route(prefix="/", upstream="http://upstream:8000", name="default"),))
    recorder = Recorder(Settings(routes=settings.routes, record=Records(path=str(path))))
    assert len(recorder.sinks) == 1
    recorder.record(timeline())
    recorder.record(timeline())
    assert record_files_at(path) == []  # still in the buffer: one write per second at most under load
    recorder.close()  # no worker thread ever ran, and close still flushes and closes the file
    assert len(records(path)) == 2


@pytest.mark.e2e
def test_records_are_written_on_the_recorder_thread(
    sim: str, proxy_factory: Any, telemetry: Telemetry, tmp_path: Path
) -> None:
    path = tmp_path / "r"
    proxy = proxy_factory(
        Settings(routes=(Route(prefix="/", upstream=sim, name="sim"),), record=Records(path=str(path)))
    )
    (writer,) = proxy.recorder.sinks
    threads: list[str] = []
    original = writer.write

    def write(record: dict[str, Any]) -> None:
        threads.append(threading.current_thread().name)
        original(record)

    writer.write = write
    body = {"model": "llmtap-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(3):
        assert httpx.post(proxy.url + "/v1/chat/completions", json=body).is_success
    proxy.flush()
    assert threads == ["llmtap-recorder"] * 3
    # Flushed when the worker went idle: readable while the proxy runs.
    assert len(records(path)) == 3


def test_bad_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    good = json.dumps({SCHEMA_KEY: 1, "seq": 1})
    lines = [
        good,
        '{"level": "info", "msg": "some other program"}',
        "not json at all",
        json.dumps({SCHEMA_KEY: 3, "seq": 2}),  # a version this reader does not know
        '{"llmtap_record":1,"seq":3,"ttf',  # cut short, then appended after
        json.dumps({SCHEMA_KEY: 1, "seq": 4}),
        "[1, 2]",
    ]
    path.write_text("\n".join(lines) + "\n" + good[:20])
    stats = ReadStats()
    assert [r["seq"] for r in read_records(path, stats)] == [1, 4]
    assert (stats.records, stats.truncated, stats.foreign, stats.other_schema) == (2, 2, 3, 1)
    # The same lines in a dataset folder, one file compressed and one cut short mid-compression: the same
    # records, and the cut-short file counts as one truncated line.
    root = tmp_path / "ds" / "date=2026-01-01" / "hour=00"
    root.mkdir(parents=True)
    (root / "a.jsonl.gz").write_bytes(gzip.compress(path.read_bytes()))
    (root / "a.jsonl").write_bytes(b"not read: its compressed copy is")
    (root / "b.jsonl.gz").write_bytes(gzip.compress(good.encode() * 400)[:-12])  # one long line, cut short
    again = ReadStats()
    assert [r["seq"] for r in read_records(tmp_path / "ds", again)] == [1, 4]
    assert (again.records, again.truncated, again.foreign, again.other_schema) == (2, 3, 3, 1)


def test_record_settings(tmp_path: Path) -> None:
    base = {"upstream": "http://upstream:8000"}
    assert build(base, env={}).record == Records()
    assert Records().rotate_s == 3600 and Records().keep_bytes == 2048 << 20 and Records().keep_s == 7 * 86400
    env = {
        "LLMTAP_RECORD": str(tmp_path / "a"),
        "LLMTAP_RECORD_MAX_MB": "0.5",
        "LLMTAP_RECORD_ROTATE_MINUTES": "5",
        "LLMTAP_RECORD_KEEP_MB": "10",
        "LLMTAP_RECORD_KEEP_HOURS": "2",
        "LLMTAP_RECORD_LOGS": "true",
    }
    assert build(base, env=env).record == Records(
        path=str(tmp_path / "a"),
        max_bytes=1 << 19,
        rotate_s=300,
        keep_bytes=10 << 20,
        keep_s=7200,
        logs=True,
        journal=str(tmp_path / "a" / ".journal"),
    )
    config = tmp_path / "llmtap.yaml"
    config.write_text(
        "record: {path: /var/log/llmtap, max_mb: 8, keep_mb: 100}\n"
        "prompt_version: everywhere\n"
        "routes:\n"
        "  - {prefix: /a, upstream: 'http://a:1', prompt_version: v2, cache_min_tokens: 2048}\n"
        "  - {prefix: /b, upstream: 'http://b:1'}\n"
    )
    settings = build({"config": str(config), "record_keep_hours": 4}, env={})
    assert settings.record == Records(
        path="/var/log/llmtap",
        max_bytes=8 << 20,
        keep_bytes=100 << 20,
        keep_s=4 * 3600,
        journal="/var/log/llmtap/.journal",
    )
    by_prefix = {r.prefix: r for r in settings.routes}
    assert (by_prefix["/a"].prompt_version, by_prefix["/a"].cache_min_tokens) == ("v2", 2048)
    assert (by_prefix["/b"].prompt_version, by_prefix["/b"].cache_min_tokens) == ("everywhere", None)
    for flags in (
        {"record_max_mb": 0},
        {"record_keep_mb": 0},
        {"record_rotate_minutes": -1},
        {"prompt_version": "a\tb"},
        {"cache_min_tokens": 0},
    ):
        with pytest.raises(ConfigError):
            build(base | flags, env={})
    with pytest.raises(ConfigError, match=r"^--prompt-version v+…: expected a label of 1 to 128 bytes"):
        build(base | {"prompt_version": "v" * 129}, env={})


@pytest.mark.e2e
def test_serve_writes_records_until_it_stops(sim: str, tmp_path: Path) -> None:
    path = tmp_path / "records"
    port, admin = free_port(), free_port()
    cmd = [sys.executable, "-m", "llmtap", "serve", "--upstream", sim, "--provider", "llmtap-sim"]
    cmd += ["--port", str(port), "--admin-port", str(admin), "--record", str(path), "--record-max-mb", "0.001"]
    env = {**os.environ, "OTEL_SDK_DISABLED": "true"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + PATIENCE
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{admin}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the proxy did not start"
            time.sleep(0.05)
        body = {"model": "llmtap-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        for version in ("v1", "v1", "v2"):
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers={"x-llmtap-prompt-version": version}
            )
            assert r.is_success
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert [r["prompt_version"] for r in records(path)] == ["v1", "v1", "v2"]
    # A new file past 1 kB: one request each; every one closed and compressed by the time serve stopped.
    files = record_files_at(path)
    assert len(files) == 3 and all(f.name.endswith(".jsonl.gz") for f in files), files
    assert all(gzip.decompress(f.read_bytes()).endswith(b"\n") for f in files)


def test_an_unwritable_record_path_stops_serve_with_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cmd = [sys.executable, "-m", "llmtap", "serve", "--upstream", "http://127.0.0.1:9", "--port", "0"]
    cmd += ["--admin-port", "0", "--record", str(blocker / "records")]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "OTEL_SDK_DISABLED": "true"}
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "record folder" in out.stderr, out.stderr


class _Held(LogRecordExporter):
    """A collector that takes log records only when let, and refuses them while ``refuse`` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.refuse = False
        self.taken: list[Any] = []

    def export(self, batch: Sequence[Any]) -> LogRecordExportResult:
        self.go.wait(PATIENCE)
        if self.refuse:
            return LogRecordExportResult.FAILURE
        self.taken.extend(batch)
        return LogRecordExportResult.SUCCESS

    def shutdown(self) -> None:
        self.go.set()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def test_record_log_records_wait_bounded_and_every_lost_one_is_counted() -> None:
    held = _Held()
    lost: dict[str, int] = {}
    sink = LogSink(held, capacity=4, on_drop=lambda reason, n: lost.update({reason: lost.get(reason, 0) + n}))
    trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    for i in range(10):  # the collector holds the first export: 4 wait, 6 are turned away at once
        sink.write({SCHEMA_KEY: 2, "seq": i, "trace_id": trace_id, "span_id": span_id, "time": "2026-01-01T00:00:00"})
    assert lost == {"otlp_queue_full": 6}
    held.go.set()
    deadline = time.monotonic() + PATIENCE
    while len(held.taken) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    first = held.taken[0]
    assert first.log_record.body["seq"] == 0 and first.log_record.event_name == "llmtap.request"
    assert (first.log_record.trace_id, first.log_record.span_id) == (int(trace_id, 16), int(span_id, 16))
    held.refuse = True
    sink.write({SCHEMA_KEY: 2, "seq": 10})
    sink.close(PATIENCE)
    assert lost == {"otlp_queue_full": 6, "otlp_export_failed": 1} and len(held.taken) == 4


def test_record_logs_without_an_otlp_logs_endpoint_is_a_clear_error() -> None:
    routes = (Route(prefix="/", upstream="http://upstream:8000", name="default"),)
    with pytest.raises(ConfigError, match="--record-logs needs an OTLP logs endpoint"):
        Recorder(Settings(routes=routes, record=Records(logs=True)))


def test_closed_files_can_become_parquet_and_read_back_as_the_lines_were(tmp_path: Path) -> None:
    every = dict.fromkeys(json.loads((ROOT / "docs" / "record.schema.json").read_text())["required"])
    lines = [
        every | {SCHEMA_KEY: 2, "time": "2026-01-01T00:00:00.000+00:00", "span_id": "1234567890123456", "pid": i,
         "record_id": f"{i + 1:032d}",
         "gaps": {"n": 0} if i % 2 else {"n": 3, "p50": 0.01, "p95": 0.02, "max": 0.03},
         "objective": None if i % 3 else {"shape": "short", "percentile": 95, "ttft": 0.5}}
        for i in range(50)
    ]  # fmt: skip
    writer = DatasetWriter(tmp_path / "pq", ME, max_bytes=3000, parquet=True)
    for line in lines:
        writer.write(line)
        writer.flush()
    writer.close()
    files = record_files_at(tmp_path / "pq")
    assert len(files) > 1 and all(f.name.endswith(".parquet") for f in files), files
    assert not list((tmp_path / "pq").rglob("*.jsonl"))
    assert records(tmp_path / "pq") == lines  # strings stay strings (an ISO time, a span id of digits)
    assert Records(format="parquet") == build({"upstream": "http://u:1", "record_format": "parquet"}, env={}).record


def test_the_record_journal_sits_in_the_record_folder_unless_told_otherwise(tmp_path: Path) -> None:
    base = {"upstream": "http://upstream:8000"}
    assert build({**base, "record": str(tmp_path)}, env={}).record.journal == str(tmp_path / ".journal")
    assert build({**base, "record": str(tmp_path), "record_journal": "off"}, env={}).record.journal is None
    env = {"LLMTAP_RECORD_JOURNAL": str(tmp_path / "j"), "LLMTAP_RECORD_JOURNAL_MB": "64"}
    record = build({**base, "record_clickhouse": "http://ch:8123"}, env=env).record
    assert (record.journal, record.journal_bytes) == (str(tmp_path / "j"), 64 << 20)
    # Without --record and without a folder: no journal (nowhere that is known to survive a restart).
    assert build({**base, "record_clickhouse": "http://ch:8123"}, env={}).record.journal is None
