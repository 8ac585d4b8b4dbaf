"""HTTPS upstreams: the lean client over real TLS sockets, and the ``tls_*`` settings.

A CA, server and client certificates come from ``trustme``; the upstreams are blocking ``ssl`` servers in
threads (OpenSSL sends its alerts as a real server does, TLS 1.3's ``certificate required`` included), so
one serves the client's asyncio loop, uvloop, and the whole proxy alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from llmtap import cli
from llmtap.config.load import build
from llmtap.config.types import ConfigError, Route, Settings
from llmtap.relay import tls
from llmtap.relay.forward import Upstreams
from llmtap.relay.upstream import SURPLUS, LeanTransport, errors
from llmtap.telemetry import semconv as sc
from tests.conftest import PATIENCE, Running, Telemetry

# Every byte value, and a length that spans several TLS records.
BODY = bytes(range(256)) * 300


@dataclass
class Files:
    """PEM files of a private PKI."""

    ca: str
    server_cert: str  # chain and key, for "localhost" and 127.0.0.1
    other_cert: str  # chain and key, for upstream.internal only
    self_signed: str  # a self-signed certificate and its key (the CA's own)
    client_cert: str  # the client's certificate alone
    client_key: str
    client_both: str  # the client's key and certificate in one file
    ca_obj: trustme.CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Files:
    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    client = ca.issue_cert("llmtap-client")

    def write(name: str, *blobs: bytes) -> str:
        path = folder / name
        path.write_bytes(b"".join(blobs))
        return str(path)

    server = ca.issue_cert("localhost", "127.0.0.1")
    other = ca.issue_cert("upstream.internal")
    return Files(
        ca=write("ca.pem", ca.cert_pem.bytes()),
        server_cert=write("server.pem", server.private_key_pem.bytes(), *(b.bytes() for b in server.cert_chain_pems)),
        other_cert=write("other.pem", other.private_key_pem.bytes(), *(b.bytes() for b in other.cert_chain_pems)),
        self_signed=write("self.pem", ca.private_key_pem.bytes(), ca.cert_pem.bytes()),
        client_cert=write("client-cert.pem", *(b.bytes() for b in client.cert_chain_pems)),
        client_key=write("client-key.pem", client.private_key_pem.bytes()),
        client_both=write("client.pem", client.private_key_pem.bytes(), *(b.bytes() for b in client.cert_chain_pems)),
        ca_obj=ca,
    )


Handler = Callable[[ssl.SSLSocket, "TLSServer"], None]


def read_request(sock: ssl.SSLSocket, buffered: bytearray) -> bytes | None:
    """One request's head (its body skipped by Content-Length); None when the client closed."""
    while b"\r\n\r\n" not in buffered:
        data = sock.recv(65536)
        if not data:
            return None
        buffered += data
    end = buffered.index(b"\r\n\r\n") + 4
    head = bytes(buffered[:end])
    length = 0
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(buffered) < end + length:
        buffered += sock.recv(65536)
    del buffered[: end + length]
    return head


def answer_all(response: bytes) -> Handler:
    """Answer every request on the connection with ``response`` until the client closes."""

    def handle(sock: ssl.SSLSocket, server: TLSServer) -> None:
        buffered = bytearray()
        while (head := read_request(sock, buffered)) is not None:
            server.heads.append(head)
            sock.sendall(response)

    return handle


OK = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)


class TLSServer:
    """A TLS server in a thread, one thread per connection; counts connections and handshake failures."""

    def __init__(
        self,
        cert: str,
        handler: Handler | None = None,
        *,
        client_ca: str | None = None,
        version: ssl.TLSVersion | None = None,
    ) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert)
        if version is not None:
            self.context.minimum_version = self.context.maximum_version = version
        self.context.set_alpn_protocols(["http/1.1"])
        if client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(client_ca)
        self.handler = handler or answer_all(OK)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.connections = 0
        self.failures: list[str] = []
        self.alpn: list[str | None] = []
        self.peers: list[str | None] = []
        #: Per connection: whether its handshake resumed an earlier session.
        self.resumed: list[bool] = []
        self.heads: list[bytes] = []
        self._threads: list[threading.Thread] = []
        self._open: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def url(self, host: str = "localhost") -> str:
        return f"https://{host}:{self.port}"

    def __enter__(self) -> TLSServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.listener.close()
        for sock in list(self._open):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(5)

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            self._open.append(raw)
            thread = threading.Thread(target=self._serve, args=(raw,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, raw: socket.socket) -> None:
        with raw:
            sock = self.context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
            try:
                sock.do_handshake()
            except (ssl.SSLError, OSError) as exc:
                self.failures.append(str(exc))
                # Read what the client sent before closing, as servers do (a close with unread data
                # would be a reset, which can overtake the alert OpenSSL just sent).
                sock.settimeout(0.5)
                with contextlib.suppress(OSError):
                    while socket.socket.recv(sock, 65536):
                        pass
                sock.close()
                return
            with sock:
                self._open.append(sock)
                self.connections += 1
                self.resumed.append(bool(sock.session_reused))
                self.alpn.append(sock.selected_alpn_protocol())
                peer = sock.getpeercert()
                self.peers.append(None if not peer else str(peer.get("subjectAltName", ((None, None),))[0][1]))
                with contextlib.suppress(OSError):
                    self.handler(sock, self)


def _client(upstreams: Upstreams, r: Route) -> httpx.AsyncClient:
    """httpx's client over a route's pool of llmtap's own client (an httpx transport too)."""
    return httpx.AsyncClient(transport=upstreams.pool(r), timeout=5, trust_env=False, follow_redirects=False)


def route(url: str, **tls: Any) -> Route:
    return Route(prefix="/", upstream=url, name="tls", **tls)


async def get(upstream_route: Route, path: str = "/v1/x", **kwargs: Any) -> httpx.Response:
    upstreams = Upstreams(Settings(routes=(upstream_route,)))
    try:
        client = _client(upstreams, upstream_route)
        return await client.get(upstream_route.upstream + path, **kwargs)
    finally:
        await upstreams.aclose()


# --- the lean client ------------------------------------------------------------------------------------------


def test_https_upstream_with_a_private_ca_bytes_identical_and_connection_reused(run: Any, pki: Files) -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)

    def handle(sock: ssl.SSLSocket, server: TLSServer) -> None:
        buffered = bytearray()
        for response in (OK, chunked):
            if read_request(sock, buffered) is None:
                return
            sock.sendall(response)
        read_request(sock, buffered)

    with TLSServer(pki.server_cert, handle) as up:
        r = route(up.url(), tls_ca=pki.ca)

        async def scenario() -> None:
            upstreams = Upstreams(Settings(routes=(r,)))
            try:
                client = _client(upstreams, r)
                first = await client.get(up.url() + "/a")
                second = await client.post(up.url() + "/b", content=b"{}")
                assert first.content == BODY and second.content == BODY
                assert SURPLUS in first.extensions
            finally:
                await upstreams.aclose()

        run(scenario())
        assert up.connections == 1  # the second request went on the first one's connection: one handshake
        assert up.alpn == ["http/1.1"]
        assert up.failures == []


def test_tls_streams_at_once_each_byte_identical_through_the_shared_read_buffer(run: Any, pki: Files) -> None:
    """Every upstream connection reads into the process's one buffer: streams interleaved read by read, each
    connection's answer is still its own, byte for byte (a read left in the buffer would show in another's)."""
    streams = 6
    bodies = {f"/s{i}": bytes([i]) * 7 + BODY[i * 97 :] for i in range(streams)}

    def handle(sock: ssl.SSLSocket, server: TLSServer) -> None:
        head = read_request(sock, bytearray())
        if head is None:
            return
        body = bodies[head.split(b" ")[1].decode()]
        sock.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for start in range(0, len(body), 4099):  # several TLS records a piece, pieces apart in time
            piece = body[start : start + 4099]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            time.sleep(0.002)
        sock.sendall(b"0\r\n\r\n")

    with TLSServer(pki.server_cert, handle) as up:
        r = route(up.url(), tls_ca=pki.ca)

        async def scenario() -> None:
            upstreams = Upstreams(Settings(routes=(r,)))
            try:
                client = _client(upstreams, r)
                answers = await asyncio.gather(*(client.get(up.url() + path) for path in bodies))
                assert [a.content for a in answers] == list(bodies.values())
            finally:
                await upstreams.aclose()

        run(scenario())
        assert up.connections == streams and up.failures == []


def test_lean_client_reaches_https_upstreams_by_default(run: Any, pki: Files) -> None:
    with TLSServer(pki.server_cert) as up:
        r = route(up.url(), tls_ca=pki.ca)

        async def scenario() -> None:
            upstreams = Upstreams(Settings(routes=(r,)))
            try:
                assert isinstance(upstreams.pool(r), LeanTransport)
                assert (await _client(upstreams, r).get(up.url())).content == BODY
            finally:
                await upstreams.aclose()

        run(scenario())


def test_idle_tls_connection_closed_unseen_by_the_loop_is_not_used(run: Any, pki: Files) -> None:
    """The liveness check polls the TCP socket under TLS: a close the loop has not read yet is still seen."""
    closed = threading.Event()

    def handle(sock: ssl.SSLSocket, server: TLSServer) -> None:
        buffered = bytearray()
        read_request(sock, buffered)
        sock.sendall(OK)
        if server.connections == 1:
            time.sleep(0.1)
            sock.shutdown(socket.SHUT_RDWR)
            closed.set()
        else:
            read_request(sock, buffered)

    with TLSServer(pki.server_cert, handle) as up:
        transport = LeanTransport(ssl_context=ssl.create_default_context(cafile=pki.ca))

        async def scenario() -> None:
            async with httpx.AsyncClient(transport=transport, timeout=5) as c:
                assert (await c.get(up.url())).content == BODY
                assert closed.wait(PATIENCE)  # blocks the loop: it sees nothing of the close
                time.sleep(0.05)  # noqa: ASYNC251 (the point: the loop must not run before the next request)
                assert (await c.get(up.url())).content == BODY

        run(scenario())
        assert up.connections == 2


def answer_once(server_side: ssl.SSLSocket, server: TLSServer) -> None:
    """One request answered, then the connection closed (so every request needs a new one)."""
    if read_request(server_side, bytearray()) is not None:
        server_side.sendall(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2])
def test_a_new_connection_resumes_the_tls_session_of_the_last(run: Any, pki: Files, version: ssl.TLSVersion) -> None:
    """Three requests on three connections: the first handshake is full, the next two resume its session (a
    TLS 1.3 ticket; a TLS 1.2 ticket or id), as nginx's proxy_ssl_session_reuse does."""
    with TLSServer(pki.server_cert, answer_once, version=version) as up:
        r = route(up.url(), tls_ca=pki.ca)
        context = tls.route_context(r)
        assert isinstance(context, tls.ResumingContext)
        context.sessions.clear()  # the context is the process's: other tests' servers left sessions in it

        async def scenario() -> None:
            upstreams = Upstreams(Settings(routes=(r,)))
            try:
                for _ in range(3):
                    assert (await _client(upstreams, r).get(up.url() + "/v1/x")).content == b"ok"
            finally:
                await upstreams.aclose()

        run(scenario())
        assert up.connections == 3
        assert up.resumed == [False, True, True]
        assert up.failures == []


def test_a_server_that_cannot_resume_the_session_gets_a_full_handshake(run: Any, pki: Files) -> None:
    """The session of one server offered to another under the same name (its ticket key differs, as after a
    restart): it declines, the handshake is a full one, the request goes through, and its session is kept."""
    with TLSServer(pki.server_cert, answer_once) as first, TLSServer(pki.server_cert, answer_once) as second:
        routes = route(first.url(), tls_ca=pki.ca), route(second.url(), tls_ca=pki.ca)
        context = tls.route_context(routes[0])
        assert context is tls.route_context(routes[1])  # one context for both: the name's session is offered
        assert isinstance(context, tls.ResumingContext)
        context.sessions.clear()

        async def scenario() -> None:
            for r in (*routes, routes[1]):
                upstreams = Upstreams(Settings(routes=(r,)))
                try:
                    assert (await _client(upstreams, r).get(r.upstream + "/v1/x")).content == b"ok"
                finally:
                    await upstreams.aclose()

        run(scenario())
        assert first.resumed == [False]
        assert second.resumed == [False, True]  # declined the first server's session; resumed its own
        assert first.failures == second.failures == []


def test_ssl_cert_file_is_honoured_when_no_tls_ca_is_given(
    run: Any, pki: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    with TLSServer(pki.server_cert) as up:
        monkeypatch.setenv("SSL_CERT_FILE", pki.ca)
        settings = build({"upstream": up.url()}, env={})
        assert settings.routes[0].tls_ca is None

        async def scenario() -> None:
            assert (await get(settings.routes[0])).content == BODY

        run(scenario())
        # Without it, the same upstream is one nobody vouches for.
        unrelated = Path(pki.ca).parent / "unrelated-ca.pem"
        unrelated.write_bytes(trustme.CA().cert_pem.bytes())
        monkeypatch.setenv("SSL_CERT_FILE", str(unrelated))
        monkeypatch.setenv("SSL_CERT_DIR", str(Path(pki.ca).parent / "none"))

        async def refused() -> None:
            with pytest.raises(errors.ConnectFailed, match=r"^certificate verify failed: "):
                await get(build({"upstream": up.url()}, env={}).routes[0])

        run(refused())


def test_wrong_host_name_is_named_and_tls_server_name_fixes_it(run: Any, pki: Files) -> None:
    with TLSServer(pki.other_cert) as up:

        async def scenario() -> None:
            with pytest.raises(errors.ConnectFailed) as caught:
                await get(route(up.url(), tls_ca=pki.ca))
            assert str(caught.value) == (
                "certificate verify failed: Hostname mismatch, certificate is not valid for 'localhost'."
            )
            fixed = route(up.url(), tls_ca=pki.ca, tls_server_name="upstream.internal")
            response = await get(fixed)
            assert response.content == BODY
            assert b"\r\nHost: localhost:" in up.heads[-1]  # the name verified is not the Host header

        run(scenario())


def test_mutual_tls(run: Any, pki: Files) -> None:
    with TLSServer(pki.server_cert, client_ca=pki.ca) as up:

        async def scenario() -> None:
            with pytest.raises(errors.ConnectFailed) as caught:
                await get(route(up.url(), tls_ca=pki.ca))
            assert str(caught.value) == "TLS handshake failed: tlsv13 alert certificate required"
            separate = route(up.url(), tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)
            assert (await get(separate)).content == BODY
            together = route(up.url(), tls_ca=pki.ca, tls_cert=pki.client_both)
            assert (await get(together)).content == BODY

        run(scenario())
        assert up.peers == ["llmtap-client", "llmtap-client"]


def test_tls_verify_false_connects_and_warns(run: Any, pki: Files, caplog: pytest.LogCaptureFixture) -> None:
    with TLSServer(pki.self_signed) as up:
        settings = build({"upstream": up.url(), "upstream_insecure": True}, env={})
        assert settings.routes[0].tls_verify is False

        async def scenario() -> None:
            with caplog.at_level(logging.WARNING, logger="llmtap.upstream"):
                assert (await get(settings.routes[0])).content == BODY

        run(scenario())
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("'default'" in w and "NOT verified" in w and up.url() in w for w in warnings), warnings


def test_a_reader_that_stops_stops_a_tls_upstream(run: Any, pki: Files) -> None:
    """Backpressure under TLS: past the queue bound the TLS transport stops reading, the socket fills."""
    total, sent = 16 << 20, [0]

    def handle(sock: ssl.SSLSocket, server: TLSServer) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # what is held is on our side
        read_request(sock, bytearray())
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        block = b"x" * 16384
        while sent[0] < total:
            sock.sendall(block)
            sent[0] += len(block)

    with TLSServer(pki.server_cert, handle) as up:
        transport = LeanTransport(ssl_context=ssl.create_default_context(cafile=pki.ca), receive_buffer=128 << 10)

        async def scenario() -> None:
            async with httpx.AsyncClient(transport=transport, timeout=5) as c:
                async with c.stream("GET", up.url()) as response:
                    parts = response.aiter_raw()
                    got = len(await parts.__anext__())
                    await asyncio.sleep(0.5)  # the reader stops; the upstream is held back
                    held = sent[0]
                    await asyncio.sleep(0.2)
                    assert sent[0] == held < 2 << 20, (held, sent[0])
                    async for part in parts:
                        got += len(part)
                    # every byte arrives once the reader resumes (the server's own count may lag its last send)
                    assert got == total

        run(scenario())


def test_failed_handshakes_leave_no_descriptor_behind(run: Any, pki: Files) -> None:
    with TLSServer(pki.self_signed) as up:

        async def scenario() -> None:
            transport = LeanTransport(ssl_context=ssl.create_default_context())
            async with httpx.AsyncClient(transport=transport, timeout=5) as c:
                before = len(os.listdir("/proc/self/fd"))
                for _ in range(20):
                    with pytest.raises(errors.ConnectFailed, match="self-signed certificate"):
                        await c.get(up.url())
                await asyncio.sleep(0.05)
                assert len(os.listdir("/proc/self/fd")) <= before + 1

        run(scenario())


# --- settings ----------------------------------------------------------------------------------------------


def test_tls_settings_from_flags_variables_and_the_file(pki: Files, tmp_path: Path) -> None:
    flags = {
        "upstream": "https://u",
        "upstream_ca": pki.ca,
        "upstream_cert": pki.client_cert,
        "upstream_key": pki.client_key,
        "upstream_server_name": "upstream.internal",
    }
    r = build(flags, env={}).routes[0]
    assert (r.tls_ca, r.tls_cert, r.tls_key, r.tls_server_name, r.tls_verify) == (
        pki.ca,
        pki.client_cert,
        pki.client_key,
        "upstream.internal",
        True,
    )
    env = {"LLMTAP_UPSTREAM_CA": pki.ca, "LLMTAP_UPSTREAM_INSECURE": "1", "LLMTAP_UPSTREAM_SERVER_NAME": "x.y"}
    r = build({"upstream": "https://u"}, env=env).routes[0]
    assert (r.tls_ca, r.tls_verify, r.tls_server_name) == (pki.ca, False, "x.y")
    config = tmp_path / "llmtap.yaml"
    config.write_text(
        "tls_ca_dir: " + str(Path(pki.ca).parent) + "\n"
        "routes:\n"
        f"  - {{prefix: /a, upstream: 'https://a', tls_ca: '{pki.ca}', tls_cert: '{pki.client_both}'}}\n"
        "  - {prefix: /b, upstream: 'https://b', tls_verify: false}\n"
        "  - {prefix: /c, upstream: 'http://c'}\n"
    )
    a, b, c = sorted(build({"config": str(config)}, env={}).routes, key=lambda x: x.prefix)
    assert (a.tls_ca, a.tls_cert, a.tls_key, a.tls_verify) == (pki.ca, pki.client_both, None, True)
    assert (b.tls_ca, b.tls_ca_dir, b.tls_verify) == (None, str(Path(pki.ca).parent), False)
    assert (c.tls_ca, c.tls_ca_dir) == (None, None)  # the defaults are for https:// routes


def test_tls_files_that_do_not_load_stop_the_start(pki: Files, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"upstream_ca": missing}, rf"^--upstream-ca \(tls_ca\): cannot load '{missing}': "),
        ({"upstream_ca": str(garbage)}, r"^--upstream-ca \(tls_ca\): cannot load '.*garbage.pem': "),
        ({"upstream_ca_dir": missing}, r"tls_ca_dir\): '.*nope.pem' is not a directory"),
        ({"upstream_cert": missing}, rf"--upstream-cert \(tls_cert\): cannot load '{missing}'"),
        ({"upstream_cert": pki.client_cert}, r"tls_cert\): cannot load '.*client-cert.pem': "),  # no key in it
        ({"upstream_cert": pki.client_cert, "upstream_key": pki.ca}, r"tls_key\): cannot load '.*'"),
        ({"upstream_key": pki.client_key}, r"tls_key\): given without tls_cert"),
        ({"upstream_server_name": "a b"}, r"^--upstream-server-name 'a b': expected a host name"),
    ]
    for flags, message in cases:
        with pytest.raises(ConfigError, match=message) as caught:
            # The settings keep the files' names; the relay reads them when it makes the upstream's client.
            tls.check(build({"upstream": "https://u", **flags}, env={}).routes)
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"need an https:// upstream"):
        build({"upstream": "http://u", "upstream_ca": pki.ca}, env={})
    config = tmp_path / "llmtap.yaml"
    config.write_text(f"routes:\n  - {{prefix: /a, upstream: 'https://a', tls_ca: '{missing}'}}\n")
    settings = build({"config": str(config)}, env={})  # the settings build no context: nothing is read yet
    assert settings.routes[0].tls_ca == missing
    with pytest.raises(ConfigError, match=rf"^{config}: routes\[0\]\.tls_ca: cannot load '{missing}'"):
        tls.check(settings.routes)
    with pytest.raises(ConfigError, match=rf"^{config}: routes\[0\]\.tls_ca: cannot load '{missing}'"):
        Upstreams(settings)  # where the connections are made, the same message


def test_a_bad_ca_path_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.pem")
    assert cli.main(["serve", "--upstream", "https://u", "--upstream-ca", missing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tls_ca" in err and missing in err, err


# --- through the whole proxy ---------------------------------------------------------------------------------

SSE_EVENTS = [
    {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [{"index": 0, "delta": {"role": "a"}}]},
    *(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": w}}],
        }
        for w in (" alpha", " beta", " gamma", " delta")
    ),
]


def sse_stream(sock: ssl.SSLSocket, server: TLSServer) -> None:
    """An OpenAI-style chat stream, one HTTP chunk per event, a little apart."""
    buffered = bytearray()
    while read_request(sock, buffered) is not None:
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        events = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in SSE_EVENTS] + [b"data: [DONE]\n\n"]
        for event in events:
            time.sleep(0.01)
            sock.sendall(b"%x\r\n%s\r\n" % (len(event), event))
        sock.sendall(b"0\r\n\r\n")


@pytest.fixture
def tls_proxy(proxy_factory: Any, pki: Files) -> Iterator[tuple[Running, TLSServer]]:
    with TLSServer(pki.server_cert, sse_stream) as up:
        settings = build({"upstream": up.url(), "upstream_ca": pki.ca, "inject_usage": False}, env={})
        yield proxy_factory(settings), up


def test_sse_stream_through_the_proxy_over_tls(tls_proxy: tuple[Running, TLSServer], telemetry: Telemetry) -> None:
    proxy, up = tls_proxy
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    expected = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in SSE_EVENTS) + b"data: [DONE]\n\n"
    for _ in range(2):
        parts = []
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            parts = list(r.iter_raw())
        assert b"".join(parts) == expected and len(parts) > 1
    assert up.connections == 1
    proxy.flush()
    spans = [s for s in telemetry.finished() if sc.ROUTE in (s.attributes or {})]
    assert len(spans) == 2
    assert all(float(str((s.attributes or {})[sc.RESPONSE_TIME_TO_FIRST_CHUNK])) > 0 for s in spans)


def test_certificate_failure_is_named_in_the_502_and_the_log(
    proxy_factory: Any, pki: Files, caplog: pytest.LogCaptureFixture
) -> None:
    with TLSServer(pki.self_signed) as up:
        proxy = proxy_factory(build({"upstream": up.url()}, env={}))
        with caplog.at_level(logging.WARNING, logger="llmtap.proxy"):
            r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": []}, timeout=10)
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["type"] == "upstream_unreachable"
        named = f"upstream {up.url()} unreachable: certificate verify failed: self-signed certificate"
        assert error["message"] == named
        assert named in [rec.getMessage() for rec in caplog.records if rec.name == "llmtap.proxy"]
