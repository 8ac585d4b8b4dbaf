"""The ``llmtap`` command as a user runs it: a child process, real sockets, exit codes and stderr."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmtap import __version__
from tests.conftest import PATIENCE, Scripted, free_port
from tests.support.procs import stop, stop_clean, wait_ready

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
CHUNKS = 8
TOKENS = sum(3 if i % 4 == 3 else 1 for i in range(CHUNKS))


def clean_env(**extra: str) -> dict[str, str]:
    """The parent's environment without any ``OTEL_*`` or ``LLMTAP_*`` setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMTAP_"))}
    return {**env, **extra}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m llmtap ARGS`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "llmtap", *args],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=20,
    )


def assert_config_error(result: subprocess.CompletedProcess[str], needle: str) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("llmtap: error: "), result.stderr
    assert needle in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.fixture(scope="module")
def upstream() -> Iterator[Scripted]:
    up = Scripted(SCRIPT_TTFT="0.02", SCRIPT_GAP="0.005", SCRIPT_CHUNKS=str(CHUNKS))
    yield up
    up.close()


def test_unknown_config_key(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("listen: {port: 1}\nlisten_port: 2\n", encoding="utf-8")
    assert_config_error(run("serve", "--upstream", "http://127.0.0.1:9", "--config", str(cfg)), "'listen_port'")


def test_unknown_nested_config_key(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("routes:\n  - {prefix: /a, upstream: 'http://127.0.0.1:9', upstrem: x}\n", encoding="utf-8")
    assert_config_error(run("serve", "--config", str(cfg)), "routes[0]: unknown key 'upstrem'")


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://h.example", "http://u:p@h.example", "http://h/?x=1"])
def test_bad_upstream_url(url: str) -> None:
    assert_config_error(run("serve", "--upstream", url), f"llmtap: error: --upstream {url}: expected ")


def test_invalid_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("upstream: http://127.0.0.1:9\nroutes: [\n  {prefix: /a\n", encoding="utf-8")
    assert_config_error(run("serve", "--config", str(cfg)), "invalid YAML at line")


def test_invalid_yaml_keeps_the_parsers_reason(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("upstream: http://127.0.0.1:9\nlisten:\n\tport: 8080\n", encoding="utf-8")
    # A tab where YAML wants spaces: the line, the column and the parser's own words.
    assert_config_error(run("serve", "--config", str(cfg)), "invalid YAML at line 3, column 1: found character '\\t'")


def test_serve_help_is_short_and_every_setting_one_flag_away() -> None:
    short, full = run("serve", "--help"), run("serve", "--help-all")
    assert short.returncode == full.returncode == 0
    assert len(short.stdout.splitlines()) < 100 < len(full.stdout.splitlines())
    for flag in ("--upstream", "--config", "--port", "--slo-ttft-ms", "--record", "--help-all"):
        assert flag in short.stdout and flag in full.stdout, flag
    # Every flag of the table is in the long help, and the short help leaves out a less common one.
    from llmtap.config.options import OPTIONS

    for o in OPTIONS.values():
        if o.flag is not None:
            assert o.flag in full.stdout, o.flag
    assert "--chunk-span-cap" not in short.stdout


def test_switch_off_flags_say_they_switch_off() -> None:
    help_text = " ".join(run("serve", "--help-all").stdout.split())
    for flag, says in [
        ("--no-prometheus", "do not serve /metrics"),
        ("--no-inject-usage", "do not add stream_options.include_usage"),
        ("--no-forward-server-spans", "do not forward the upstream's own spans"),
    ]:
        assert f"{flag} {says}" in help_text, flag


def test_simulate_says_what_it_serves() -> None:
    from llmtap.simulator import PROFILES
    from llmtap.simulator.server import announce

    said = announce(PROFILES["support"], "127.0.0.1", 8000)
    assert "profile 'support'" in said and "model llmtap-sim" in said
    for endpoint in ("/v1/chat/completions", "/v1/messages", "/api/chat", ":streamGenerateContent", "/debug/requests"):
        assert endpoint in said, endpoint


def test_config_file_missing(tmp_path: Path) -> None:
    assert_config_error(run("serve", "--config", str(tmp_path / "nope.yaml")), "nope.yaml")


def test_bad_port() -> None:
    assert_config_error(run("serve", "--upstream", "http://127.0.0.1:9", "--port", "70000"), "port")


@pytest.mark.parametrize("which", ["--port", "--admin-port"])
def test_port_already_taken(which: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        ports = {"--port": str(free_port()), "--admin-port": str(free_port()), which: str(port)}
        result = run("serve", "--upstream", "http://127.0.0.1:9", *[x for kv in ports.items() for x in kv])
    what = "proxy listener" if which == "--port" else "admin listener"
    assert_config_error(result, f"{what} 127.0.0.1:{port}")


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"llmtap {__version__}"


def test_serve_stream_metrics_and_sigterm(upstream: Scripted) -> None:
    port, admin_port = free_port(), free_port()
    argv = ["serve", "--upstream", upstream.url, "--port", str(port), "--admin-port", str(admin_port)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmtap", *argv, "--log-level", "warning"],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        wait_ready(proc, admin)
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=10) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert len(text.split()) == TOKENS
        # The proxy asked for usage on the client's behalf and removed it again: the client sees none.
        assert all("usage" not in c or c["usage"] is None for c in chunks)

        # The recorder writes after the stream ends, off the request path: poll briefly.
        count = None
        deadline = time.monotonic() + PATIENCE
        while count is None and time.monotonic() < deadline:
            for line in httpx.get(admin + "/metrics", timeout=5).text.splitlines():
                if line.startswith("gen_ai_client_operation_duration_seconds_count{") and 'model="scripted"' in line:
                    count = float(line.rsplit(" ", 1)[1])
            time.sleep(0.05)
        assert count == 1

        stop_clean(proc)
    finally:
        stop(proc, grace=0)
