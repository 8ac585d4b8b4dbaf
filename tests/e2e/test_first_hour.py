"""What a newcomer meets in the first hour of ``llmtap serve``: a port another server holds, an upstream
that is down at start, an upstream that dies in the middle of a stream. Each answer names what to do about it."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmtap.config.types import Route
from llmtap.listener import LOG_EVERY
from llmtap.relay.breaks import StreamBreaks
from llmtap.serve.sockets import ADMIN_LISTENER, PROXY_LISTENER, bind_failure
from llmtap.telemetry.fleet.reach import TIMEOUT, Reach, Reachability, verbose
from llmtap.wire.tape import Tape, now
from tests.conftest import PATIENCE, free_port, unanswered_port
from tests.support.procs import FaultUpstream, Llmtap, upstream as upstream  # the fixture

ROOT = Path(__file__).resolve().parents[2]

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


# --- an upstream that dies mid-stream ---------------------------------------------------------------


def chat(url: str, fault: str, **headers: str) -> tuple[int, bytes]:
    """One streamed chat request through the proxy with the fault upstream's ``fault``: status and bytes received."""
    body = {"model": "fault", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
    received = b""
    sent = {"x-fault": fault, "x-fault-arg": "3", "x-request-id": uuid.uuid4().hex, **headers}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=sent, timeout=10) as r:
        with contextlib.suppress(httpx.RemoteProtocolError):  # the cut the proxy passes on
            for part in r.iter_raw():
                received += part
    return r.status_code, received


def broken_lines(proxy: Llmtap) -> list[str]:
    return [line for line in proxy.logs().splitlines() if "broke off a stream" in line]


def wait_for_lines(proxy: Llmtap, count: int) -> list[str]:
    deadline = time.monotonic() + PATIENCE
    while len(lines := broken_lines(proxy)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return lines


@pytest.mark.parametrize(
    ("fault", "why"),
    [("close-mid-stream", "RemoteProtocolError"), ("reset-mid-stream", "ReadError"), ("stall-body", "sent nothing")],
)
def test_an_upstream_dying_mid_stream_leaves_one_line_in_the_log(
    upstream: FaultUpstream, tmp_path: Path, fault: str, why: str
) -> None:
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log", "--idle-timeout", "0.5")
    try:
        started = time.monotonic()
        status, received = chat(proxy.url, fault, **{"x-keep": "1"})
        took = time.monotonic() - started
        assert status == 200 and received
        (line,) = wait_for_lines(proxy, 1)
        found = re.search(
            r"upstream (\S+) broke off a stream of route (\S+) after (\d+) bytes relayed, ([\d.]+) s into the "
            r"request: (.*)$",
            line,
        )
        assert found, line
        assert found[1] == upstream.url and found[2] == "default"
        # What the upstream wrote is what was relayed (the client asked for no usage, so the proxy asked for it and
        # took its event out: the upstream's bytes are at least the client's).
        assert int(found[3]) >= len(received) > 0
        assert 0 < float(found[4]) <= took
        assert why in found[5], line
        assert "WARNING" in line
    finally:
        proxy.close()


def test_a_flood_of_broken_streams_is_one_line_per_route_per_interval(upstream: FaultUpstream, tmp_path: Path) -> None:
    proxy = Llmtap(upstream.url, tmp_path / "llmtap.log")
    try:
        started = time.monotonic()
        for _ in range(30):
            assert chat(proxy.url, "close-mid-stream")[0] == 200
        took = time.monotonic() - started
        lines = wait_for_lines(proxy, 1)
        time.sleep(0.5)  # a line that was still to come would be here by now
        lines = broken_lines(proxy)
        # One line opens each interval of LOG_EVERY seconds in which streams broke; the later ones count the rest.
        assert 1 <= len(lines) <= 1 + int(took // LOG_EVERY), lines
        # Every break is said once: by a line of its own, or in the count of the next line.
        said = len(lines) + sum(int(m[1]) for line in lines if (m := re.search(r"\((\d+) more on this route", line)))
        assert said <= 30, lines
    finally:
        proxy.close()


def test_stream_breaks_log_each_route_once_per_interval_and_count_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    clock = [100.0]
    breaks = StreamBreaks(every=10.0, clock=lambda: clock[0])
    tape = Tape(
        1, method="POST", path="/v1/x", inner_path="/v1/x", route="a", protocol=None, received=now(), received_wall_ns=0
    )
    tape.read(now(), b"x" * 42)
    with caplog.at_level(logging.WARNING, logger="llmtap.proxy"):
        for _ in range(5):
            breaks.broke("a", "http://up-a", tape, "ReadError: reset")
        breaks.broke("b", "http://up-b", tape, "ReadError: reset")
        clock[0] += 9.9
        breaks.broke("a", "http://up-a", tape, "ReadError: reset")
        clock[0] += 0.2
        breaks.broke("a", "http://up-a", tape, "ReadTimeout: upstream sent nothing for 1 s")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("upstream http://up-a broke off a stream of route a after 42 bytes relayed, ")
    assert lines[0].endswith(" s into the request: ReadError: reset")
    assert lines[1].startswith("upstream http://up-b broke off a stream of route b")
    # The first line of the next interval counts the breaks the interval before it did not say.
    assert lines[2].endswith(
        "ReadTimeout: upstream sent nothing for 1 s (5 more on this route since its last such line)"
    )
    assert breaks.count == {"a": 7, "b": 1}


# --- an upstream that is down: readiness, the start-up warning, /readyz?verbose ---------------------


def unreachable_lines(proxy: Llmtap) -> list[str]:
    return [line for line in proxy.logs().splitlines() if "cannot be reached" in line]


def test_a_dead_upstream_is_warned_at_start_and_shown_on_verbose_readyz_but_leaves_llmtap_ready(
    tmp_path: Path,
) -> None:
    port = free_port()  # nothing listens here yet
    dead = f"http://127.0.0.1:{port}"
    proxy = Llmtap(dead, tmp_path / "llmtap.log")
    try:
        deadline = time.monotonic() + PATIENCE
        while not unreachable_lines(proxy) and time.monotonic() < deadline:
            time.sleep(0.05)
        (line,) = unreachable_lines(proxy)
        assert "WARNING" in line and f"upstream {dead} (route default) cannot be reached" in line, line
        assert "Connection refused" in line and "/readyz?verbose" in line, line
        # Readiness is llmtap's own: the replica stays in the Service and answers 502 naming the upstream.
        plain = httpx.get(proxy.admin_url + "/readyz", timeout=10)
        assert plain.status_code == 200 and plain.text.startswith("ready"), plain.text
        relayed = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "m"}, timeout=10)
        assert relayed.status_code == 502 and dead in relayed.text
        shown = httpx.get(proxy.admin_url + "/readyz?verbose", timeout=10)
        assert shown.status_code == 200, shown.text
        lines = shown.text.splitlines()
        assert lines[0] == "[+]relays ok (1/1 relays)" and lines[-1] == "readyz check passed", lines
        assert f"[-]upstream {dead} (route default) unreachable: 127.0.0.1:{port}: Connection refused" in lines
        # The upstream comes up: within the reuse of an answer (FRESH seconds), verbose readiness says so.
        with socket.create_server(("127.0.0.1", port)):
            deadline = time.monotonic() + PATIENCE
            while "[+]upstream" not in (text := httpx.get(proxy.admin_url + "/readyz?verbose", timeout=10).text):
                assert time.monotonic() < deadline, text
                time.sleep(0.2)
        assert re.search(rf"^\[\+\]upstream {re.escape(dead)} \(route default\) reachable \([\d.]+ ms\)$", text, re.M)
        assert "unreachable" not in text
    finally:
        proxy.close()


def test_an_upstream_that_never_answers_does_not_delay_the_start(tmp_path: Path) -> None:
    with unanswered_port() as port:
        proxy = Llmtap(f"http://127.0.0.1:{port}", tmp_path / "llmtap.log")
        try:
            deadline = time.monotonic() + PATIENCE
            while not unreachable_lines(proxy) and time.monotonic() < deadline:
                time.sleep(0.05)
            (line,) = unreachable_lines(proxy)
            assert f"no connection to 127.0.0.1:{port} within {TIMEOUT:g} s" in line, line
            # The admin listener began serving, and the relay listening, before the check ended: it ran beside the
            # start, and nothing of the start waited for it (a check awaited first would come before both).
            log = proxy.logs()
            assert log.index("uvicorn.admin: Started server process") < log.index(line), log
            assert log.index("proxy on http://127.0.0.1:") < log.index(line), log
        finally:
            proxy.close()


def routes(*pairs: tuple[str, str]) -> list[Route]:
    return [Route(prefix=f"/{name}", upstream=url, name=name) for name, url in pairs]


async def test_reach_checks_each_address_once_for_all_its_routes_and_reuses_a_fresh_answer() -> None:
    clock = [0.0]
    with socket.create_server(("127.0.0.1", 0)) as alive:
        up = f"http://127.0.0.1:{alive.getsockname()[1]}"
        down = f"http://127.0.0.1:{free_port()}"
        reach = Reach(routes(("a", up), ("b", up + "/v1"), ("c", down)), fresh=2.0, clock=lambda: clock[0])
        found = await reach.check()
        assert [(r.upstream, r.routes, r.error is None) for r in found] == [
            (up, ("a", "b"), True),
            (down, ("c",), False),
        ]
        assert found[1].error is not None and "Connection refused" in found[1].error
        accepted = alive.accept()[0]  # the check's one connection, closed at once without a byte
        assert accepted.recv(1) == b""
        accepted.close()
        # Within ``fresh`` seconds the same answer, whatever changed; past it, a new check.
        clock[0] = 1.9
        assert await reach.check() is found
    clock[0] = 2.1
    again = await reach.check()
    assert again is not found and again[0].error is not None


def test_verbose_readiness_is_decided_by_the_relays_alone() -> None:
    up = Reachability("http://up", ("a",), None, 0.0012)
    down = Reachability("http://down", ("b", "c"), "down:80: Connection refused", 0.0004)
    assert verbose(True, "1/1 relays", [up]) == (
        "[+]relays ok (1/1 relays)\n[+]upstream http://up (route a) reachable (1.2 ms)\nreadyz check passed\n"
    )
    text = verbose(False, "0/2 relays", [up, down]).splitlines()
    assert text[0] == "[-]relays not ready (0/2 relays)" and text[-1] == "readyz check failed"
    assert "[-]upstream http://down (route b, c) unreachable: down:80: Connection refused" in text
    assert verbose(True, "", [down]).splitlines()[-1] == "readyz check passed"
