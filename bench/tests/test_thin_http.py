"""The HTTP floor (``bench.probes.thin_http``) relays what an HTTP proxy must: a floor that got the framing wrong
would be measured doing less than llmtap does.

An upstream of the test's own (a socket thread) answers a counted answer, then a chunked one, on one keep-alive
connection, each with hop-by-hop fields; the client sends hop-by-hop fields too. Both ways, the floor must write the
head again without them and the body whole, in its framing, in plain and in ``--tasks`` mode.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

COUNTED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\nkeep-alive: timeout=5\r\n"
    b'connection: keep-alive\r\n\r\n{"ok":true}'
)
CHUNKED = (
    b"HTTP/1.1 201 Created\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"connection: keep-alive\r\n\r\n6\r\ndata: \r\n3\r\none\r\n0\r\n\r\n"
)


class Upstream:
    """Takes one connection, reads two requests (each a head and a counted body), answers each in turn."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        conn.settimeout(20)
        buf = b""
        with conn:
            for answer in (COUNTED, CHUNKED):
                while b"\r\n\r\n" not in buf:
                    buf += conn.recv(65536)
                head, _, buf = buf.partition(b"\r\n\r\n")
                fields = [line.split(b":", 1) for line in head.split(b"\r\n")[1:]]
                length = next(int(value) for name, value in fields if name.lower() == b"content-length")
                while len(buf) < length:
                    buf += conn.recv(65536)
                self.heads.append(head)
                self.bodies.append(buf[:length])
                buf = buf[length:]
                conn.sendall(answer)


@pytest.mark.parametrize("mode", [[], ["--tasks"]], ids=["callbacks", "tasks"])
def test_the_floor_writes_each_head_again_without_hop_by_hop_fields_and_every_body_in_its_framing(
    mode: list[str],
) -> None:
    up = Upstream()
    floor = subprocess.Popen(
        [sys.executable, "-m", "bench.probes.thin_http", "--upstream-port", str(up.port), *mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert floor.stdout is not None
        port = int(floor.stdout.readline())
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        hop = {"Connection": "keep-alive, x-hop", "Keep-Alive": "timeout=9", "TE": "trailers", "X-End": "kept"}
        client.request("POST", "/v1/embeddings?x=1", body=b'{"input":"a"}', headers=hop)
        first = client.getresponse()
        assert (first.status, first.read()) == (200, b'{"ok":true}')
        assert first.getheader("content-length") == "11" and first.getheader("keep-alive") is None
        client.request("POST", "/v1/chat/completions", body=b"{}", headers={"X-End": "kept"})
        second = client.getresponse()
        assert second.status == 201 and second.getheader("transfer-encoding") == "chunked"
        assert second.read() == b"data: one"  # de-chunked by the client: framed again as chunks by the floor
        client.close()
    finally:
        floor.kill()
        floor.wait(10)
        if floor.stdout is not None:
            floor.stdout.close()
    up.thread.join(10)
    up.sock.close()
    assert up.bodies == [b'{"input":"a"}', b"{}"]
    first_head = up.heads[0].split(b"\r\n")
    assert first_head[0] == b"POST /v1/embeddings?x=1 HTTP/1.1"
    names = {line.split(b":", 1)[0].lower() for line in first_head[1:]}
    assert {b"x-end", b"content-length", b"host"} <= names
    assert not names & {b"connection", b"keep-alive", b"te"}
