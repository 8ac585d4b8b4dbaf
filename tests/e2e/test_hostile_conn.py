"""Hostile clients on raw sockets, through a real ``llmtap serve``: slow heads, idle connections, stalled
uploads and too many connections.

Each is bounded (``--client-header-timeout``, ``--keep-alive-timeout``, ``--client-body-timeout``,
``--max-client-connections``; short here so the tests are quick), answered where there is a request to
answer, counted in ``/metrics`` from 0, and, except routine idle closes, logged.
"""

from __future__ import annotations

import json
import socket
import time

import httpx

from tests.support.procs import Llmtap, Serve, metric_value, serve as serve, upstream as upstream  # the fixtures

TIMEOUTS = "llmtap_client_timeouts_total"
REFUSED = "llmtap_connections_refused_total"
CHAT = {"model": "fault", "stream": True, "messages": [{"role": "user", "content": "Say something."}]}
#: The longest any cut may take past its deadline on a busy machine.
SLACK = 8.0


def connect(proxy: Llmtap) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=SLACK)


def echo(sock: socket.socket) -> bytes:
    """Send ``GET /echo`` (the upstream answers with a Content-Length) and read the whole response."""
    sock.sendall(b"GET /echo HTTP/1.1\r\nhost: llmtap\r\n\r\n")
    sock.settimeout(SLACK)
    got = b""
    while b"\r\n\r\n" not in got:
        data = sock.recv(65536)
        assert data, got
        got += data
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        data = sock.recv(65536)
        assert data, got
        body += data
    return head


def read_until_closed(sock: socket.socket, within: float) -> tuple[bytes, float]:
    """Everything the proxy sends until it closes the connection, and when (``time.monotonic()``) it did."""
    sock.settimeout(within)
    got = b""
    while True:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the connection was still open after {within} s; got {got[:200]!r}") from None
        if not data:
            return got, time.monotonic()
        got += data


def request(path: str = "/v1/chat/completions", body: bytes = b"", length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return (
        f"POST {path} HTTP/1.1\r\nhost: llmtap\r\ncontent-type: application/json\r\ncontent-length: {size}\r\n\r\n"
    ).encode() + body


def counted(proxy: Llmtap, name: str, label: str, value: str, at_least: float) -> float:
    """The counter's value once it reaches ``at_least`` (the relay reports twice a second), or what it was."""
    deadline = time.monotonic() + SLACK
    while True:
        seen = metric_value(proxy.metrics(), name, **{label: value})
        if seen >= at_least or time.monotonic() > deadline:
            return seen
        time.sleep(0.1)


def exported(proxy: Llmtap, name: str, label: str, value: str) -> bool:
    """True when ``/metrics`` has the series at all (a counter at 0 is a value, not an absence)."""
    return any(line.startswith(f'{name}{{{label}="{value}"}} ') for line in proxy.metrics().splitlines())


def test_a_head_sent_a_byte_at_a_time_gets_408_at_the_header_timeout(serve: Serve) -> None:
    proxy = serve("--client-header-timeout", "1", "--keep-alive-timeout", "30")
    assert exported(proxy, TIMEOUTS, "llmtap_timeout_kind", "header")
    sock = connect(proxy)
    started = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
    # Then a header, a byte every 0.2 s: never silent for long, never done. The deadline runs from the first byte.
    sock.settimeout(0.2)
    for byte in b"x-slow: " + b"a" * int((1 + SLACK) / 0.2):
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(1, socket.MSG_PEEK):
                break  # answered
        except TimeoutError:
            continue
        except OSError:
            break
    got, closed_at = read_until_closed(sock, SLACK)
    sock.close()
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert b"connection: close" in got.lower()
    assert 0.9 <= closed_at - started <= 1 + SLACK
    assert counted(proxy, TIMEOUTS, "llmtap_timeout_kind", "header", 1) == 1
    assert "header timeout" in proxy.logs()


def test_an_idle_connection_is_closed_new_or_between_requests(serve: Serve) -> None:
    proxy = serve("--keep-alive-timeout", "1", "--client-header-timeout", "30")
    assert exported(proxy, TIMEOUTS, "llmtap_timeout_kind", "idle")
    # A connection that never sends a byte.
    fresh = connect(proxy)
    started = time.monotonic()
    got, closed_at = read_until_closed(fresh, 1 + SLACK)
    fresh.close()
    assert got == b"" and closed_at - started >= 0.9
    # One that sends a request, reads its answer, then only blank lines (which begin no request).
    used = connect(proxy)
    assert echo(used).startswith(b"HTTP/1.1 200 ")
    answered = time.monotonic()
    for _ in range(int((1 + SLACK) / 0.2)):
        try:
            used.sendall(b"\r\n")
        except OSError:
            break
        time.sleep(0.2)
    got, closed_at = read_until_closed(used, SLACK)
    used.close()
    assert got == b""  # no answer: the blank lines were no request
    assert 0.9 <= closed_at - answered <= 1 + SLACK
    assert counted(proxy, TIMEOUTS, "llmtap_timeout_kind", "idle", 2) == 2


def test_the_idle_deadline_runs_from_the_last_response_not_an_earlier_one(serve: Serve) -> None:
    # The connection keeps one idle timer: set for the first response's deadline, it fires while the connection
    # is idle after the second, and must then wait for the second's deadline.
    proxy = serve("--keep-alive-timeout", "2", "--client-header-timeout", "30")
    sock = connect(proxy)
    assert echo(sock).startswith(b"HTTP/1.1 200 ")
    first = time.monotonic()
    time.sleep(1.2)
    assert echo(sock).startswith(b"HTTP/1.1 200 ")
    time.sleep(max(0.0, first + 2.2 - time.monotonic()))  # the first response's deadline has passed
    assert echo(sock).startswith(b"HTTP/1.1 200 ")  # still open
    answered = time.monotonic()
    got, closed_at = read_until_closed(sock, 2 + SLACK)
    sock.close()
    assert got == b"" and 1.9 <= closed_at - answered <= 2 + SLACK


def test_a_stalled_upload_gets_408_and_lets_go_of_its_admission_slot(serve: Serve) -> None:
    # The proxy reads 1 KiB of a body before admitting it, so a body that stalls past that holds the one slot.
    proxy = serve(
        "--client-body-timeout",
        "1",
        "--max-concurrency",
        "1",
        "--keep-alive-timeout",
        "30",
        env={"LLMTAP_MAX_INSPECT_BYTES": "1024"},
    )
    assert exported(proxy, TIMEOUTS, "llmtap_timeout_kind", "body")
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 20_000}]}).encode()
    stalled = connect(proxy)
    stalled.sendall(request(body=body[:8000], length=len(body)))
    assert counted(proxy, "llmtap_streams_active", "llmtap_route", "default", 1) == 1  # admitted: it holds the slot
    started = time.monotonic()
    answer = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=1 + 2 * SLACK)
    waited = time.monotonic() - started
    assert answer.status_code == 200 and b"[DONE]" in answer.content
    assert waited <= 1 + 2 * SLACK
    got, _ = read_until_closed(stalled, SLACK)
    stalled.close()
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert b"connection: close" in got.lower() and got.endswith(b"request body stalled\n")
    assert counted(proxy, TIMEOUTS, "llmtap_timeout_kind", "body", 1) == 1
    assert "body timeout" in proxy.logs()


def test_past_the_connection_cap_a_connection_gets_503_and_each_is_counted(serve: Serve) -> None:
    proxy = serve("--max-client-connections", "3", "--keep-alive-timeout", "60")
    assert exported(proxy, REFUSED, "llmtap_refusal_reason", "limit")
    held: list[socket.socket] = []
    try:
        for _ in range(3):
            sock = connect(proxy)
            assert echo(sock).startswith(b"HTTP/1.1 200 ")  # open, and kept alive
            held.append(sock)
        refusals = []
        for _ in range(4):
            extra = connect(proxy)
            extra.sendall(b"GET /echo HTTP/1.1\r\nhost: llmtap\r\n\r\n")
            got, _ = read_until_closed(extra, SLACK)
            extra.close()
            refusals.append(got)
        for got in refusals:
            assert got.startswith(b"HTTP/1.1 503 "), got
            assert b"connection: close" in got.lower() and got.endswith(b"too many client connections; retry\n")
        refused = counted(proxy, REFUSED, "llmtap_refusal_reason", "limit", 4)
        assert refused == 4, (refused, proxy.logs()[-3000:])
        # Logged, at most once per 10 s: four refusals in a burst are one line, with the count so far.
        lines = [line for line in proxy.logs().splitlines() if "refused a client connection" in line]
        assert len(lines) == 1 and "max_client_connections is 3" in lines[0], lines
        # The cap is on connections open now: one closes, the next one is served.
        held.pop().close()
        deadline = time.monotonic() + SLACK
        while True:
            try:
                status = httpx.get(proxy.url + "/echo", timeout=SLACK).status_code
            except httpx.TransportError:
                status = 0
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == 200
    finally:
        # Closed on a failure too: a socket left to the collector warns in whichever test runs next.
        for sock in held:
            sock.close()
