"""What a newcomer meets in the first hour of ``llmtap serve`` (issue 43): a port another server holds, an upstream
that is down at start, an upstream that dies in the middle of a stream. Each answer names what to do about it."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmtap.serve.sockets import ADMIN_LISTENER, PROXY_LISTENER, bind_failure
from tests.conftest import free_port
from tests.procs import Llmtap

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.e2e


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``llmtap serve ARGS`` expected to stop by itself (a start that fails); killed, and a failure, past 30 s."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMTAP_"))}
    return subprocess.run(
        [sys.executable, "-m", "llmtap", "serve", "--upstream", "http://127.0.0.1:9", *args],
        cwd=ROOT,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
    )


def refused(result: subprocess.CompletedProcess[str], address: str, *names: str) -> None:
    """Exit 2 with one line naming the address, the system's reason and every way to give the setting."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("llmtap: error: "), result.stderr
    assert address in lines[0] and "Address already in use" in lines[0], lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llmtap]:
    running = Llmtap("http://127.0.0.1:9", tmp_path_factory.mktemp("first") / "llmtap.log")
    yield running
    running.close()


def test_a_second_serve_on_the_proxy_port_is_told_to_change_the_port(first: Llmtap) -> None:
    result = serve("--port", str(first.port), "--admin-port", str(free_port()))
    refused(result, f"proxy listener 127.0.0.1:{first.port}", "--port", "LLMTAP_PORT", "listen.port in the --config")


def test_a_second_serve_on_the_admin_port_is_told_to_change_the_admin_port(first: Llmtap) -> None:
    result = serve("--port", str(free_port()), "--admin-port", str(first.admin_port))
    where = f"admin listener 127.0.0.1:{first.admin_port}"
    refused(result, where, "--admin-port", "LLMTAP_ADMIN_PORT", "admin.port in the --config")
    # Given by the variable, the same answer: every place the setting can come from is named.
    by_env = serve("--port", str(free_port()), env={"LLMTAP_ADMIN_PORT": str(first.admin_port)})
    refused(by_env, where, "--admin-port", "LLMTAP_ADMIN_PORT", "admin.port in the --config")


def test_a_second_serve_with_workers_does_not_join_the_first_ones_port(tmp_path: Path) -> None:
    """Relays share their port through SO_REUSEPORT, and the supervisor's reservation of it is never listening: a
    second ``--workers`` server must still be refused, not quietly take half of the first one's connections."""
    one = Llmtap("http://127.0.0.1:9", tmp_path / "llmtap.log", "--workers", "2")
    try:
        result = serve("--workers", "2", "--port", str(one.port), "--admin-port", str(free_port()))
        refused(result, f"proxy listener 127.0.0.1:{one.port}", "--port", "LLMTAP_PORT")
        assert one.proc.poll() is None, one.logs()
    finally:
        one.close()


@pytest.mark.parametrize(
    ("code", "options", "names"),
    [
        (
            errno.EACCES,
            PROXY_LISTENER,
            ("ports below 1024", "a port from 1024 with --port, LLMTAP_PORT or listen.port"),
        ),
        (errno.EADDRNOTAVAIL, ADMIN_LISTENER, ("another address with --admin-host, LLMTAP_ADMIN_HOST or admin.host",)),
    ],
)
def test_each_bind_failure_names_the_setting_that_fixes_it(
    code: int, options: tuple[str, str], names: tuple[str, ...]
) -> None:
    message = bind_failure("proxy listener", "10.0.0.1", 80, OSError(code, os.strerror(code)), options)
    assert message.startswith(f"proxy listener 10.0.0.1:80: {os.strerror(code)}: ")
    for name in names:
        assert name in message, message
    # A failure no setting fixes is said as the system says it.
    other = OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))
    assert bind_failure("x", "h", 1, other, options) == f"x h:1: {os.strerror(errno.ENOBUFS)}"
