"""The HTTP/1.1 server protocol llmtap runs under uvicorn: httptools, with bounds on what a client may hold.

httptools (llhttp) has no limit of its own on a request line or header block: uvicorn would buffer a
gigabyte of header bytes from one client. This protocol counts what arrives while a head is incomplete
and answers 431 (RFC 6585 section 5) once it passes ``h11_max_incomplete_event_size``, the limit uvicorn's
h11 protocol applies to the same thing, which ``llmtap.serve.server`` sets to ``max_header_bytes``. Only bytes
of a request head are counted: request bodies and responses pay nothing.

uvicorn has no timeout on a request's head or body either, and only arms its keep-alive timer after a
response: a client sending a header a byte a second, a connection that never sends anything, or an upload
that stops halfway would each be kept forever, and enough of them exhaust the descriptors (then every
new connection fails, and nothing says why). So, after ``ClientLimits``:

* idle: a connection with no request in progress is closed ``keep_alive`` seconds after it opened or after
  its last response ended (one timer per connection, looked at when it fires; blank lines, which begin no request,
  do not extend it);
* header: a request's line and headers must all arrive within ``header_timeout`` of its first byte, else 408;
* body: while a body is arriving, a silence past ``body_timeout`` gets 408 (when no response started) and
  the application sees ``http.disconnect``, so the request lets go of its admission slot and its upstream.
  Silence the proxy causes (it stopped reading, or has not yet asked for a ``100-continue`` body) is not
  the client's;
* send: while the response is held back because the client does not read it (the transport's write buffer
  is past its high-water mark), a silence past ``send_timeout`` in which the client took no byte cuts the
  connection: the application sees ``http.disconnect``, so the request lets go of its admission slot and
  its upstream (nginx's ``send_timeout``). The timer runs only while writing is paused;
* a connection past ``max_connections`` open ones is answered 503 and closed at once;
* a connection from an address that already holds ``per_client`` open ones is answered 503 and closed at
  once, without lingering: one client's idle sockets cannot use up the connections every other client
  needs (the address is the peer's IP; behind a load balancer that is the balancer's).

Each is counted by kind in ``ClientLimits`` (the relay reports the counts to the telemetry process) and,
except idle closes, which are routine, logged at most once per ``LOG_EVERY`` seconds. The timers are armed
only while a head or body is still incomplete after a read, and a body's timer is not moved on each read but
checks, when it fires, how long the client was really silent: a request that arrives in one read, and every
response byte, cost nothing.

It also stamps each request with the moment its first byte was read from the socket (``RECEIVED`` in
the scope's extensions): TTFT as the client sees it starts there, not when the application is called,
so time the proxy spends before its handler runs (a busy event loop) shows in its own numbers. And it hands
the relay the request's own response cycle (``CYCLE``): the relay then writes each relayed body part to the
client's transport from the upstream's read callback (``llmtap.relay.pipe``), in the framing uvicorn chose.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.logging import TRACE_LOG_LEVEL
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmtap.config.types import Settings
from llmtap.wire.messages import CLIENT_TIMEOUT_KINDS, CONNECTION_REFUSAL_REASONS

__all__ = [
    "CYCLE",
    "LOG_EVERY",
    "LOST_HOOK",
    "RECEIVED",
    "BoundedHeadProtocol",
    "ClientLimits",
    "connection_cap",
    "local_address",
    "peer_address",
]

log = logging.getLogger("llmtap.proxy")

DEFAULT_MAX_HEAD = 64 * 1024
#: The scope extension holding the ``time.perf_counter()`` of the read that brought a request's first byte.
RECEIVED = "llmtap.received"
#: Seconds between two log lines about the same kind of cut or refusal; the counters have every one.
LOG_EVERY = 10.0
#: The scope extension holding the request's uvicorn response cycle (its transport, flow control, framing).
CYCLE = "llmtap.cycle"
#: The attribute of a request's cycle that ``connection_lost`` calls, when the relay set one, while the response
#: is not complete: the relay cancels its stream at once (``llmtap.relay.app``), with no task of its own.
LOST_HOOK = "llmtap_on_lost"
#: The most client connections a relay takes by default, and the descriptors kept back from the limit
#: for everything else (listeners, the channel, log files); each client may need an upstream connection too.
DEFAULT_CAP = 4096
_RESERVED_FDS = 64
#: How long a refused or timed-out connection is read (and its bytes dropped) after its answer, so the
#: answer is not lost to a reset when the client's unread request is still arriving (RFC 9112 section 9.6).
LINGER = 2.0


def _answer(status: bytes, text: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: " + str(len(text)).encode() + b"\r\nconnection: close\r\n" + extra + b"\r\n" + text
    )


_RESPONSE_431 = _answer(b"431 Request Header Fields Too Large", b"request line and headers too large\n")
_RESPONSE_408_HEAD = _answer(b"408 Request Timeout", b"request line and headers not received in time\n")
_RESPONSE_408_BODY = _answer(b"408 Request Timeout", b"request body stalled\n")
_RESPONSE_503 = _answer(b"503 Service Unavailable", b"too many client connections; retry\n", b"retry-after: 1\r\n")
_RESPONSE_503_PER_CLIENT = _answer(
    b"503 Service Unavailable", b"too many connections from this address; retry\n", b"retry-after: 1\r\n"
)


def connection_cap(configured: int | None) -> int:
    """``max_client_connections``, or by default half of the descriptors left above a reserve, at most 4096."""
    if configured is not None:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_CAP
    return max(16, min(DEFAULT_CAP, (soft - _RESERVED_FDS) // 2))


def per_client_cap(configured: int | None, cap: int) -> int | None:
    """``max_connections_per_client``: by default three quarters of the connection cap, so one address never
    holds them all while a lone client (a sidecar's application) keeps most of them; 0 turns the bound off."""
    if configured is None:
        return max(1, cap - cap // 4)
    return configured or None


class ClientLimits:
    """One relay process's bounds on its clients, and absolute counts of the connections they cut or refused."""

    def __init__(
        self,
        *,
        header_timeout: float,
        body_timeout: float,
        max_connections: int,
        send_timeout: float | None = None,
        upload_timeout: float | None = None,
        per_client: int | None = None,
    ) -> None:
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_connections = max_connections
        self.send_timeout = send_timeout
        #: The silence a body still arriving may keep while its request holds an admission slot (the relay
        #: applies it, ``llmtap.relay.app``; counted here as kind ``upload``).
        self.upload_timeout = upload_timeout
        #: Open connections one peer address may hold; None: no bound of its own.
        self.per_client = per_client
        #: Open (not refused) connections by peer address.
        self.open_by_peer: dict[str, int] = {}
        self.timeouts = dict.fromkeys(CLIENT_TIMEOUT_KINDS, 0)
        self.refused = dict.fromkeys(CONNECTION_REFUSAL_REASONS, 0)
        self._logged: dict[str, float] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> ClientLimits:
        """The limits ``settings`` give (the keep-alive timeout goes to uvicorn's own timer)."""
        cap = connection_cap(settings.max_client_connections)
        return cls(
            header_timeout=settings.timeouts.client_header,
            body_timeout=settings.timeouts.client_body,
            max_connections=cap,
            send_timeout=settings.timeouts.client_send,
            upload_timeout=settings.timeouts.client_upload,
            per_client=per_client_cap(settings.max_connections_per_client, cap),
        )

    def join(self, peer: str) -> bool:
        """Count a new connection from ``peer``; False (not counted) when the address holds its share already."""
        held = self.open_by_peer.get(peer, 0)
        if self.per_client is not None and held >= self.per_client:
            return False
        self.open_by_peer[peer] = held + 1
        return True

    def leave(self, peer: str) -> None:
        """A connection counted by ``join`` closed."""
        held = self.open_by_peer.get(peer, 0) - 1
        if held > 0:
            self.open_by_peer[peer] = held
        else:
            self.open_by_peer.pop(peer, None)

    def counts(self) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]:
        """(timeouts by kind, refusals by reason), as the relay's ``Stats`` message carries them (``llmtap.wire``)."""
        return tuple(self.timeouts.items()), tuple(self.refused.items())

    def timed_out(self, kind: str, client: Any) -> None:
        """Count a connection cut for ``kind``; log it, unless it is a routine idle close."""
        self.timeouts[kind] += 1
        if kind == "header":
            why = f"no complete request line and headers within {self.header_timeout:g} s"
        elif kind == "body":
            why = f"its request body stalled for {self.body_timeout:g} s"
        elif kind == "send":
            why = f"it read nothing of the response for {self.send_timeout:g} s"
        elif kind == "upload":
            why = f"its request body stalled for {self.upload_timeout:g} s while it held an admission slot"
        else:
            return
        self._log(kind, "closed a client connection from %s: %s (%s timeout; %d so far)", _peer(client), why, kind)

    def refuse(self, reason: str, client: Any, open_now: int) -> None:
        """Count and log a connection refused for ``reason`` (``limit``: all clients', ``per_client``: its own)."""
        self.refused[reason] += 1
        if reason == "per_client":
            setting, most = "max_connections_per_client", self.per_client
        else:
            setting, most = "max_client_connections", self.max_connections
        self._log(
            reason,
            "refused a client connection from %s with 503: %d open, %s is %s (%d refused so far)",
            _peer(client),
            open_now,
            setting,
            most,
        )

    def _log(self, key: str, message: str, *args: Any) -> None:
        """Log at most once per ``LOG_EVERY`` seconds per ``key``, with the count so far as the last argument."""
        clock = time.monotonic()
        if clock - self._logged.get(key, -LOG_EVERY) < LOG_EVERY:
            return
        self._logged[key] = clock
        total = self.refused[key] if key in self.refused else self.timeouts[key]
        log.warning(message, *args, total)


def local_address(transport: asyncio.Transport) -> tuple[str, int | None] | None:
    """The transport's own address as uvicorn reports it (``get_local_addr``): host and port for IP (an IPv6
    address's flow and scope left out), the path alone for a Unix socket, None when unknown."""
    info = _extra(transport, "sockname")
    if isinstance(info, (tuple, list)) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    if isinstance(info, str):
        return (info, None)
    return None


def peer_address(transport: asyncio.Transport) -> tuple[str, int] | None:
    """The peer's address as uvicorn reports it (``get_remote_addr``): host and port for IP, else None."""
    info = _extra(transport, "peername")
    if isinstance(info, (tuple, list)) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    return None


def _extra(transport: asyncio.Transport, name: str) -> Any:
    try:
        return transport.get_extra_info(name)
    except OSError:  # a peer already gone, on some loops
        return None


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown address"


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounds on a request head's size and time, a body's silence, idle
    connections and how many are open (see the module's docstring)."""

    _head_bytes = -1  # bytes received while the current request head is incomplete; -1 outside a head
    _read_at = 0.0  # when the data being parsed was read
    _heard_at = 0.0  # when the client last sent anything, or the proxy last stopped holding it back
    _head_at = 0.0  # when the current request head's first byte was read
    _heads = 0  # request heads begun on this connection
    _in_body = False  # a request's head is complete, its body is not
    _detached = False  # refused or timed out: input is no longer parsed, no timer runs
    _timer: asyncio.TimerHandle | None = None
    _timer_kind = ""  # "header" or "body" while ``_timer`` runs
    _linger: asyncio.TimerHandle | None = None
    _peer: str | None = None  # the peer address this connection is counted under (``ClientLimits.join``)
    _send_timer: asyncio.TimerHandle | None = None
    _send_mark = 0  # the write buffer's size when the send timer was last armed
    _idle_due: float | None = None  # the loop time an idle connection closes at; None while not idle

    def __init__(self, *args: Any, limits: ClientLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Refuse a connection past the cap; else start its idle timer (uvicorn starts one only after a response)."""
        self._made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.limits.refuse("limit", self.client, len(self.connections) - 1)
            self._close_with(_RESPONSE_503)
            return
        peer = self.client[0] if self.client else None
        if peer is not None and not self.limits.join(peer):
            # Refused at once, no linger: the descriptor is what this client must not be allowed to hold.
            self.limits.refuse("per_client", self.client, self.limits.open_by_peer.get(peer, 0))
            self._detached = True
            self.transport.write(_RESPONSE_503_PER_CLIENT)
            self.transport.close()
            return
        self._peer = peer
        self._idle_until(self.loop.time() + self.timeout_keep_alive)

    def _made(self, transport: asyncio.Transport) -> None:
        """What uvicorn's ``connection_made`` sets, the two addresses read as the transport's ``sockname`` and
        ``peername``: uvicorn asks for the transport's ``socket`` object instead, which uvloop builds for the
        purpose, and then its address. Measured on uvloop (``bench/RESULTS.md``, "The streaming tail at 64 on one
        core"): 9.4 µs of CPU a connection for the two against 2.5, paid by every request of a burst of new
        connections before the next one is read."""
        self.connections.add(self)
        self.transport = transport
        self.flow = FlowControl(transport)
        self.server = local_address(transport)
        self.client = peer_address(transport)
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        if self.logger.level <= TRACE_LOG_LEVEL:
            prefix = f"{self.client[0]}:{self.client[1]} - " if self.client else ""
            self.logger.log(TRACE_LOG_LEVEL, "%sHTTP connection made", prefix)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is not None:
            self.limits.leave(self._peer)
            self._peer = None
        self._disarm_send()
        self._disarm()
        self._stop_idle()
        if self._linger is not None:
            self._linger.cancel()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            hook = getattr(cycle, LOST_HOOK, None)
            if hook is not None:
                hook()

    def on_message_begin(self) -> None:
        """A request starts: its head is being received, and its first byte came with the current read."""
        super().on_message_begin()
        self.scope["extensions"] = {RECEIVED: self._read_at}  # type: ignore[dict-item]
        self._head_bytes = 0
        self._head_at = self._read_at
        self._heads += 1

    def on_headers_complete(self) -> None:
        """The head is complete: stop counting and timing it; its body, if any, is next."""
        self._head_bytes = -1
        if self._timer_kind == "header":
            self._disarm()
        self._in_body = True
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:
            # Not after an upgrade request (no cycle of its own): that one is answered through ``send`` alone.
            self.scope["extensions"][CYCLE] = cycle  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        """The body is complete: nothing more to wait for from the client until its next request."""
        self._in_body = False
        if self._timer_kind == "body":
            self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """The response is complete: the next pipelined request starts, or the connection is idle from now (uvicorn's
        own steps, the idle deadline set rather than a timer made); a request already on its way is timed by its
        own timer instead."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._idle_due = None
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self._head_bytes < 0 and not self._in_body:
            self._idle_until(self.loop.time() + self.timeout_keep_alive)

    def _unsupported_upgrade_warning(self) -> None:
        """The parser stopped at an Upgrade request (uvicorn serves no WebSocket here, ``ws="none"``).

        The relay answers the request itself (a refusal, or HTTP/1.1 for an ignorable ``h2c`` offer), and
        the parser reads nothing more on this connection, so the answer closes it. No warning: this is the
        relay's designed answer, not a fault of the server.
        """
        if self.cycle is not None:
            self.cycle.keep_alive = False

    def pause_writing(self) -> None:
        """The client stopped taking the response (the write buffer passed its high-water mark): time it."""
        super().pause_writing()
        if self._send_timer is None and self.limits.send_timeout is not None and not self.transport.is_closing():
            self._send_mark = self.transport.get_write_buffer_size()
            self._send_timer = self.loop.call_later(self.limits.send_timeout, self._send_expired)

    def resume_writing(self) -> None:
        """The client read enough for writing to go on."""
        self._disarm_send()
        super().resume_writing()

    def _disarm_send(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_expired(self) -> None:
        """``send_timeout`` passed with writing paused: cut the client unless it took some bytes meanwhile."""
        self._send_timer = None
        timeout = self.limits.send_timeout
        if self.transport.is_closing() or not self.flow.write_paused or timeout is None:
            return
        size = self.transport.get_write_buffer_size()
        if size < self._send_mark:
            # It read something (slowly): the silence starts again from here.
            self._send_mark = size
            self._send_timer = self.loop.call_later(timeout, self._send_expired)
            return
        self.limits.timed_out("send", self.client)
        # Nothing of what is queued can reach a client that does not read: drop it with the connection.
        # ``connection_lost`` then tells the application (``http.disconnect``) and wakes its blocked send.
        self._detached = True
        self._disarm()
        self._unset_keepalive_if_required()
        self.transport.abort()

    def timeout_keep_alive_handler(self) -> None:
        """An idle connection's time is up: count it, then let uvicorn close it."""
        if not self.transport.is_closing():
            self.limits.timed_out("idle", self.client)
        super().timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        """Parse, then refuse a head that grew too large, and time what is still incomplete."""
        if self._detached:
            return  # a refused or timed-out connection: read and dropped until it closes
        self._read_at = self._heard_at = time.perf_counter()
        idle = self._idle_due
        heads = self._heads
        super().data_received(data)
        if self.transport.is_closing() or self._detached:
            return
        if self._head_bytes >= 0:
            self._head_bytes += len(data)
            if self._head_bytes > (self.config.h11_max_incomplete_event_size or DEFAULT_MAX_HEAD):
                self._head_bytes = -1
                if self.cycle is None or self.cycle.response_complete:
                    self.transport.write(_RESPONSE_431)
                # Mid-response (a pipelined head), the response in flight is cut rather than interleaved.
                self.transport.close()
            elif self._timer is None:
                self._arm("header", self.limits.header_timeout - (time.perf_counter() - self._head_at))
        elif self._in_body:
            if self._timer is None:
                self._arm("body", self.limits.body_timeout)
        elif self._idle_due is None and not self.pipeline and (self.cycle is None or self.cycle.response_complete):
            # Nothing in progress: idle again. Bytes that began no request (blank lines, which RFC 9112
            # section 2.2 lets a server ignore) leave the deadline where it was.
            kept = idle is not None and self._heads == heads
            self._idle_until(idle if kept and idle is not None else self.loop.time() + self.timeout_keep_alive)

    def _unset_keepalive_if_required(self) -> None:
        """Not idle (a request begins, or the connection is being cut): the deadline goes, the timer stays, and
        finds nothing to do if it fires before the connection is idle again (``_idle_check``)."""
        self._idle_due = None

    def _idle_until(self, when: float) -> None:
        """Idle until ``when``. uvicorn makes a timer at each response's end and cancels it at the next request's
        first read (1.3 µs of CPU a request on uvloop); here the connection keeps one, set again only when it is
        due later than ``when`` or has stopped, and looks at the deadline when it fires."""
        self._idle_due = when
        timer = self.timeout_keep_alive_task
        if timer is None or timer.when() > when:
            if timer is not None:
                timer.cancel()
            self.timeout_keep_alive_task = self.loop.call_at(when, self._idle_check)

    def _idle_check(self) -> None:
        """The idle timer fired: close an idle connection whose deadline passed, come back at one still to come;
        a connection not idle now is left alone (its next response's end sets the deadline again)."""
        self.timeout_keep_alive_task = None
        due = self._idle_due
        if due is None:
            return
        if self.loop.time() >= due:
            self._idle_due = None
            self.timeout_keep_alive_handler()
        else:
            self.timeout_keep_alive_task = self.loop.call_at(due, self._idle_check)

    def _stop_idle(self) -> None:
        """The connection is gone: its idle timer too."""
        self._idle_due = None
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None

    def _arm(self, kind: str, delay: float) -> None:
        self._timer_kind = kind
        self._timer = self.loop.call_later(max(delay, 0.0), self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_kind = ""

    def _expired(self) -> None:
        """A head's deadline passed, or a body's timer came round: cut the connection, or look again later."""
        kind, self._timer, self._timer_kind = self._timer_kind, None, ""
        if self.transport.is_closing() or self._detached:
            return
        cycle = self.cycle
        if kind == "header":
            self.limits.timed_out("header", self.client)
            if cycle is None or cycle.response_complete:
                self._close_with(_RESPONSE_408_HEAD)
            else:
                # A pipelined head behind a response in flight: that response ends, then the connection.
                self._detached = True
                cycle.keep_alive = False
            return
        clock = time.perf_counter()
        if self.flow.read_paused or cycle.waiting_for_100_continue:
            # The proxy holds the body back itself (its buffer is full, or it has not asked for it yet).
            self._heard_at = clock
            self._arm("body", self.limits.body_timeout)
            return
        silence = clock - self._heard_at
        if silence < self.limits.body_timeout:
            self._arm("body", self.limits.body_timeout - silence)
            return
        self.limits.timed_out("body", self.client)
        answer = None if cycle.response_started else _RESPONSE_408_BODY
        # The application's next receive() gets http.disconnect, and what it sends from now on goes nowhere.
        cycle.disconnected = True
        cycle.message_event.set()
        self._close_with(answer)

    def _close_with(self, answer: bytes | None) -> None:
        """Answer (when there is an answer to give), stop reading requests, and close after a short linger."""
        self._detached = True
        self._disarm()
        self._unset_keepalive_if_required()
        if answer is not None:
            self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER, self.transport.close)
