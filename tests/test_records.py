"""Request records: what a line holds (and never holds), rotation, flushing, bad lines, and the settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.analysis import tokens
from proxy.settings import ConfigError, Records, Route, Settings, build
from proxy.simulator import get_profile, run_in_thread
from proxy.telemetry.recorder import Recorder
from proxy.telemetry.records import SCHEMA_KEY, ReadStats, RecordWriter, read_records, record_files
from tests.conftest import PATIENCE, Telemetry, free_port
from tests.test_recorder import timeline

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
    path = tmp_path / "rec" / "requests.jsonl"
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

    raw = path.read_bytes()
    assert CANARY_PROMPT.encode() not in raw.replace(b"no-" + CANARY_PROMPT.encode(), b"")
    assert CANARY_KEY.encode() not in raw and b"Bearer" not in raw
    streamed, whole, failed = records(path)
    assert streamed[SCHEMA_KEY] == 1
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
    assert streamed["queue_source"] and streamed["prefill_source"]
    assert streamed["gaps"]["n"] == 4 and streamed["gaps"]["p50"] <= streamed["gaps"]["max"]
    assert streamed["tokens"] == {
        "input": tokens.count(prompt),
        "input_source": "usage",
        "output": 5,
        "output_source": "usage",
        "cache_read": 0,
        "cache_write": None,
        "reasoning": None,
    }
    assert [r["name"] for r in streamed["prompt"]["regions"]] == ["m0"]
    assert streamed["prompt"]["regions"][0]["tokens"] == tokens.count(prompt)
    assert streamed["cache"]["class"] == "cold" and streamed["cache"]["min_tokens"] == 16
    assert whole["cache"]["expected_prefix_tokens"] > 0  # the same prompt, sent after the first one's prefill
    # An error keeps its type, never its message (servers quote prompts in messages).
    assert (failed["outcome"], failed["status"], failed["error_type"]) == ("error", 404, "NotFoundError")


def test_rotation_keeps_at_most_n_files(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    writer = RecordWriter(path, max_bytes=2000, files=3)
    for i in range(100):
        writer.write({SCHEMA_KEY: 1, "seq": i, "pad": "x" * 150})
    writer.close()
    files = record_files(path)
    assert [f.name for f in files] == ["r.jsonl.2", "r.jsonl.1", "r.jsonl"]
    assert all(0 < f.stat().st_size <= 2000 for f in files)
    seqs = [r["seq"] for r in records(path)]
    assert seqs == list(range(100 - len(seqs), 100)) and len(seqs) > 20
    single = RecordWriter(tmp_path / "one.jsonl", max_bytes=500, files=1)
    for i in range(20):
        single.write({SCHEMA_KEY: 1, "seq": i, "pad": "y" * 100})
    single.close()
    assert [f.name for f in record_files(tmp_path / "one.jsonl")] == ["one.jsonl"]
    assert (tmp_path / "one.jsonl").stat().st_size <= 500


def test_lines_are_buffered_until_flush_or_close(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    settings = Settings(routes=(Route(prefix="/", upstream="http://upstream:8000", name="default"),))
    recorder = Recorder(Settings(routes=settings.routes, record=Records(path=str(path))))
    assert recorder.records is not None
    recorder.record(timeline())
    recorder.record(timeline())
    assert path.read_bytes() == b""  # still in the buffer: one write per second at most under load
    recorder.close()  # no worker thread ever ran, and close still flushes and closes the file
    assert len(records(path)) == 2


@pytest.mark.e2e
def test_records_are_written_on_the_recorder_thread(
    sim: str, proxy_factory: Any, telemetry: Telemetry, tmp_path: Path
) -> None:
    path = tmp_path / "r.jsonl"
    proxy = proxy_factory(
        Settings(routes=(Route(prefix="/", upstream=sim, name="sim"),), record=Records(path=str(path)))
    )
    writer = proxy.app.recorder.records
    assert writer is not None
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
        json.dumps({SCHEMA_KEY: 2, "seq": 2}),
        '{"llmtap_record":1,"seq":3,"ttf',  # cut short, then appended after
        json.dumps({SCHEMA_KEY: 1, "seq": 4}),
        "[1, 2]",
    ]
    path.write_text("\n".join(lines) + "\n" + good[:20])
    stats = ReadStats()
    assert [r["seq"] for r in read_records(path, stats)] == [1, 4]
    assert (stats.records, stats.truncated, stats.foreign, stats.other_schema) == (2, 2, 3, 1)
    # A writer opened on a file that ends mid-line ends that line first, so its own first line is whole.
    writer = RecordWriter(path)
    writer.write({SCHEMA_KEY: 1, "seq": 5})
    writer.close()
    again = ReadStats()
    assert [r["seq"] for r in read_records(path, again)] == [1, 4, 5]
    assert again.truncated == 2


def test_record_settings(tmp_path: Path) -> None:
    base = {"upstream": "http://upstream:8000"}
    assert build(base, env={}).record == Records()
    env = {"LLMTAP_RECORD": str(tmp_path / "a.jsonl"), "LLMTAP_RECORD_MAX_MB": "0.5", "LLMTAP_RECORD_FILES": "3"}
    assert build(base, env=env).record == Records(path=str(tmp_path / "a.jsonl"), max_bytes=1 << 19, files=3)
    config = tmp_path / "llmtap.yaml"
    config.write_text(
        "record: {path: /var/log/llmtap.jsonl, max_mb: 8, files: 2}\n"
        "prompt_version: everywhere\n"
        "routes:\n"
        "  - {prefix: /a, upstream: 'http://a:1', prompt_version: v2, cache_min_tokens: 2048}\n"
        "  - {prefix: /b, upstream: 'http://b:1'}\n"
    )
    settings = build({"config": str(config), "record_files": 4}, env={})
    assert settings.record == Records(path="/var/log/llmtap.jsonl", max_bytes=8 << 20, files=4)
    by_prefix = {r.prefix: r for r in settings.routes}
    assert (by_prefix["/a"].prompt_version, by_prefix["/a"].cache_min_tokens) == ("v2", 2048)
    assert (by_prefix["/b"].prompt_version, by_prefix["/b"].cache_min_tokens) == ("everywhere", None)
    for flags in ({"record_max_mb": 0}, {"record_files": 0}, {"prompt_version": "a\tb"}, {"cache_min_tokens": 0}):
        with pytest.raises(ConfigError):
            build(base | flags, env={})
    with pytest.raises(ConfigError, match=r"^--prompt-version v+…: expected a label of 1 to 128 bytes"):
        build(base | {"prompt_version": "v" * 129}, env={})


@pytest.mark.e2e
def test_serve_writes_records_until_it_stops(sim: str, tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    port, admin = free_port(), free_port()
    cmd = [sys.executable, "-m", "proxy", "serve", "--upstream", sim, "--provider", "llmtap-sim"]
    cmd += ["--port", str(port), "--admin-port", str(admin), "--record", str(path), "--record-files", "2"]
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
    assert path.read_bytes().endswith(b"\n")


def test_an_unwritable_record_path_stops_serve_with_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cmd = [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9", "--port", "0"]
    cmd += ["--admin-port", "0", "--record", str(blocker / "records.jsonl")]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "OTEL_SDK_DISABLED": "true"}
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "record file" in out.stderr, out.stderr
