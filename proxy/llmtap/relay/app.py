"""The ASGI applications: the relay (pure ASGI on the response path) and the admin listener."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import zlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, NoReturn

import httpx

from llmtap.compression import InflateLimit, Inflater, decodable
from llmtap.config.types import Route, Settings
from llmtap.listener import CYCLE, LOST_HOOK, RECEIVED
from llmtap.providers import provider_for
from llmtap.providers.bodyscan import BodyScan
from llmtap.providers.usage_filter import UsageEventFilter
from llmtap.relay.admission import Admission, QueueFull
from llmtap.relay.answers import LogLimit, bad_head, refuse_request, send_json, too_large, upstream_failed
from llmtap.relay.bodyread import Body, ClientGone, RequestTooLarge, UploadStalled, prepend, read_body, spliced
from llmtap.relay.breaks import StreamBreaks
from llmtap.relay.channel import Channel, LocalChannel, ShardedChannel, SocketChannel
from llmtap.relay.fingerprint import KEY_HEADERS, fingerprint, install_secret
from llmtap.relay.forward import (
    PRIVATE_PREFIX,
    Router,
    Upstreams,
    close_if_surplus,
    request_headers,
    response_headers,
    upstream_url,
)
from llmtap.relay.frame import relay_frame
from llmtap.relay.guard import Refusal, check_request, check_route
from llmtap.relay.heads import unrelayable
from llmtap.relay.pipe import ClientLeft, Pipe, strip_part as _strip
from llmtap.relay.shared import InFlight, Table, table_columns
from llmtap.relay.timing import HEADER as TIMING_HEADER, server_timing
from llmtap.relay.upstream_http import PIPE, Answer, LeanTransport, Origin, Pieces
from llmtap.types import OBJECTIVE_HEADERS, Message, Receive, Scope, Send
from llmtap.wire.ledger import Ledger, new_relay_id
from llmtap.wire.messages import RESPONSE_CUT_REASONS, Raw, Stats, encode_stats, without_bytes
from llmtap.wire.tape import Tape, now, shard_of
from llmtap.wire.tracecontext import Sampler, begin
from llmtap.wire.tracestate import entry, upstream_tracestate

if TYPE_CHECKING:
    from llmtap.listener import ClientLimits

__all__ = [
    "STATS_EVERY",
    "ProxyApp",
    "create_app",
]

log = logging.getLogger("llmtap.proxy")

PROMPT_VERSION_HEADER = b"x-llmtap-prompt-version"
#: At shutdown, how long requests cancelled at the drain deadline get to hand over their tapes.
_SETTLE_SECONDS = 2.0
#: Seconds between two reports of the relay's gauges (active streams, admission line) when they changed.
STATS_EVERY = 0.5
#: At a request's end the gauges are reported at once, unless a report left less than this long ago: then once,
#: this long after it (a burst of ends costs one report, not one each; the gauges still settle within it).
STATS_SOON = 0.02


class ProxyApp:
    """The relay: forwards any request to its route's upstream, and records what it saw on a tape.

    Nothing here parses a response, counts a token or calls OpenTelemetry: each finished request's tape
    goes through ``channel`` to the telemetry side, which does all of that (``llmtap.telemetry``): a
    telemetry process, or a recorder in this process that whoever built the app made
    (``llmtap.serve.local``). The relay never builds telemetry.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        channel: Channel,
        transport: httpx.AsyncBaseTransport | None = None,
        shared: Table | None = None,
    ) -> None:
        self.settings = settings
        self.router = Router(settings.routes)
        self.upstreams = Upstreams(settings, transport)
        self.channel = channel
        #: Trace ids are made here; a disabled SDK means no spans, so the client's trace headers pass as sent.
        self.tracing = not settings.telemetry.sdk_disabled
        self.sampler = Sampler.from_env()
        #: This replica's ``tracestate`` entry (``llmtap.wire.tracestate``): the model server's span of a request then
        #: says which replica relayed it, wherever the server sends it. None: one replica, nothing to route.
        peer = settings.telemetry
        self.owner_entry = entry(peer.peer_address, peer.peer_token) if peer.peer_address and peer.peer_token else None
        #: The API-key fingerprints' secret: the operator's, else the install's (made at the first key seen).
        self._key_secret = settings.attribution.key
        #: The caller's ``x-llmtap-*`` headers go upstream too.
        self.forward_private = settings.attribution.forward_headers
        #: The caller's ``x-slo-*`` objectives go upstream too (read either way).
        self.forward_objectives = settings.forward_slo_headers
        self.ready = False
        #: Set on SIGTERM: streams still running at the drain deadline are cut and recorded as ``shutdown``.
        self.draining = False
        #: Requests between arrival and the hand-over of their tape.
        self.inflight = 0
        self._idle = asyncio.Event()  # set while ``inflight`` is 0
        self._idle.set()
        # What the relays of the server count together (``--workers``; else this relay's own table).
        shared = shared if shared is not None else Table(table_columns(settings))
        #: The admission queue of each route that limits its concurrency (the server's, over every relay).
        self.admissions = {
            r.name: Admission(r.max_concurrency, r.queue_limit, r.queue_timeout, table=shared, route=r.name)
            for r in settings.routes
            if r.max_concurrency is not None
        }
        # Requests in flight to each upstream (every relay's), and a sequence number: what the estimator replays.
        self.upstream_inflight = InFlight(shared)
        self._upstream_seq = 0
        self._keys = itertools.count(1)
        # With several telemetry processes, each request's tape goes to one of them, by its trace id
        # (``shard_of``); they tell each other what must be whole per upstream (``llmtap.telemetry.siblings``).
        self._shards = channel.shards
        # What the telemetry side's gauges show, sent as absolute values (a dropped message loses nothing).
        self._active = {r.name: 0 for r in settings.routes}
        self._waiting = {r.name: 0 for r in settings.routes}
        #: Tapes that did not reach the telemetry side, in whole or in part.
        self.tapes_dropped = 0
        #: This relay, to the telemetry side's record journal: its id, and per telemetry process the number of the
        #: last stream end handed to the channel (``End.seq``: a gap there is an end lost on its way).
        self.relay_id = new_relay_id()
        self._handed = [0] * self._shards
        #: The ledger of those numbers in the journal's folder, for the next start after a kill of the whole tree
        #: (``llmtap.wire.ledger``; ``llmtap.serve.relay`` opens it); None: none kept.
        self.ledger: Ledger | None = None
        # The reports go to telemetry process 0: one started again hears the counts at once, not at the next change.
        first = channel.channels[0] if isinstance(channel, ShardedChannel) else channel
        if isinstance(first, SocketChannel):
            first.on_connected = self._report_again
        #: Responses the relay itself cut short, by reason (``RESPONSE_CUT_REASONS``), reported with the gauges.
        self.cuts = dict.fromkeys(RESPONSE_CUT_REASONS, 0)
        #: Streams the upstream broke off after their headers, logged within a bound (``llmtap.relay.breaks``).
        self.breaks = StreamBreaks()
        #: Responses answered 502 for a head that cannot be relayed faithfully (``llmtap.relay.heads``).
        self.bad_heads = 0
        self._said = LogLimit()
        #: The server's counts of client connections cut or refused (``llmtap.serve.relay`` sets it), reported
        #: beside the gauges; None when no such server runs this app.
        self.connections: ClientLimits | None = None
        self._counts_sent: tuple[Any, ...] = ()
        self._ready_sent: bool | None = None
        self._stats_changed = True
        self._stats_task: asyncio.Task[None] | None = None
        #: When the gauges were last reported (the loop's clock), and the report due soon, if one is.
        self._stats_at = -STATS_SOON
        self._stats_due: asyncio.TimerHandle | None = None
        #: Per route: llmtap's own client and the upstream's origin when the relay calls it directly, else None.
        self._direct: dict[str, tuple[LeanTransport, Origin] | None] = {}
        #: Upstream URL -> its request target as httpx encodes it (``_target``).
        self._targets: dict[str, bytes] = {}

        #: The Starlette application around the relay: what a server serves (``__call__`` is its call).
        self.frame = relay_frame(self._endpoint, startup=self.startup, shutdown=self.shutdown)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.frame(scope, receive, send)

    async def _endpoint(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The catch-all route: every HTTP request, raw ASGI."""
        if scope["type"] == "http":
            await self.handle(scope, receive, send)
        elif scope["type"] == "websocket":
            # A WebSocket upgrade (uvicorn hands those over as their own scope) is not relayed.
            await send({"type": "websocket.close", "code": 1008, "reason": "llmtap relays HTTP only"})

    async def startup(self) -> None:
        """Ready to relay; the gauges' values go to the telemetry side from now on."""
        self.ready = True
        self._stats_changed = True
        self._stats_task = asyncio.create_task(self._report_stats())

    async def shutdown(self) -> None:
        """Let the last tapes go, close the upstream pools and the channel (which drains a local recorder)."""
        self.ready = False
        await self._settle()
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
        if self._stats_due is not None:
            self._stats_due.cancel()
            self._stats_due = None
        self._stats_changed = True
        self._send_stats()
        await self.aclose()

    async def _settle(self) -> None:
        """Let requests the server just cancelled (drain deadline) hand over their tapes first."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_SETTLE_SECONDS):
                await self._idle.wait()

    async def _report_stats(self) -> None:
        while True:
            self._send_stats()
            await asyncio.sleep(STATS_EVERY)

    def _send_stats(self) -> None:
        counts = (
            *(self.connections.counts() if self.connections is not None else ((), ())),
            tuple(self.cuts.items()),
        )
        if not self._stats_changed and counts == self._counts_sent:
            return
        ready = self.ready and not self.draining
        message = encode_stats(
            Stats(
                ready,
                self.tapes_dropped,
                tuple(self._active.items()),
                tuple(self._waiting.items()),
                *counts,
                relay=self.relay_id,
            )
        )
        # A change of readiness leaves at once (``/readyz`` follows it); the gauges may wait for the tapes' gather.
        if self.channel.send(message, at_once=ready != self._ready_sent):
            self._ready_sent = ready
            self._stats_changed = False
            self._counts_sent = counts
            with contextlib.suppress(RuntimeError):  # no running loop: a report at shutdown, from a thread
                self._stats_at = asyncio.get_running_loop().time()

    def _report_again(self) -> None:
        """The channel to telemetry process 0 was made (again): the gauges and counts go with the next report."""
        self._stats_changed = True
        self._counts_sent = ()
        self._ready_sent = None  # its readiness too, at once: /readyz of a restarted telemetry process follows it

    def begin_drain(self) -> None:
        """SIGTERM: report not ready; streams in flight may finish until the server's drain deadline."""
        self.ready = False
        self.draining = True
        self._stats_changed = True
        # Now, not at the next report (up to STATS_EVERY later): /readyz must say so from the drain's start.
        self._send_stats()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (from another thread) until every request so far is recorded; True when done in time."""
        deadline = time.monotonic() + timeout
        while self.inflight:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        if not isinstance(self.channel, LocalChannel):
            return True
        return self.channel.flush(max(deadline - time.monotonic(), 0.1))

    def _install_secret(self) -> bytes:
        """The install's fingerprint secret, read (or made) once per process."""
        self._key_secret = install_secret()
        return self._key_secret

    async def aclose(self) -> None:
        """Close the upstream pools and the channel (which drains a local recorder)."""
        await self.upstreams.aclose()
        await self.channel.aclose()

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Relay one HTTP request."""
        extensions = scope.get("extensions") or {}
        received = extensions.get(RECEIVED) or now()
        # Taken out of the scope at once: the cycle refers to the scope, which need not refer back.
        cycle = extensions.pop(CYCLE, None)
        wall = time.time_ns() - round((now() - received) * 1e9)
        settings = self.settings
        refusal = check_request(
            scope, max_header_bytes=settings.max_header_bytes, max_request_bytes=settings.max_request_bytes
        )
        if refusal is not None:
            await refuse_request(send, refusal)
            return
        path: str = scope["path"]
        route = self.router.match(path)
        if route is None:
            await send_json(send, 404, "no_route", f"no route for {path}")
            return
        refusal = check_route(scope.get("raw_path") or path.encode(), route)
        if refusal is not None:
            await refuse_request(send, refusal)
            return
        method: str = scope["method"]
        inner_path = path[len(route.prefix) :] if route.strip_prefix and route.prefix != "/" else path
        provider = provider_for(method, inner_path)
        tape = Tape(
            next(self._keys),
            method=method,
            path=path,
            inner_path=inner_path,
            route=route.name,
            protocol=provider.name if provider else None,
            received=received,
            received_wall_ns=wall,
        )
        headers: list[tuple[bytes, bytes]] = list(scope["headers"])
        traceparent = tracestate = None
        for name, value in headers:
            lowered = name.lower()
            if lowered.startswith(PRIVATE_PREFIX):
                if lowered == PROMPT_VERSION_HEADER:
                    tape.prompt_version = value
                else:
                    # Attribution (tenant, user, properties): read and bounded in the telemetry process.
                    tape.attribution.append((lowered, value))
            elif lowered in OBJECTIVE_HEADERS:
                # Per-request objectives ride with the attribution headers: read in the telemetry process.
                tape.attribution.append((lowered, value))
            elif lowered in KEY_HEADERS and tape.key_fingerprint is None:
                tape.key_fingerprint = fingerprint(self._key_secret or self._install_secret(), value)
            elif lowered == b"traceparent":
                traceparent = value.decode("latin-1")
            elif lowered == b"tracestate":
                # Several fields are one list (RFC 9110 section 5.3; W3C Trace Context section 3.3.1.1).
                part = value.decode("latin-1")
                tracestate = part if tracestate is None else f"{tracestate},{part}"
        trace: list[tuple[bytes, bytes]] | None = None
        if self.tracing:
            ids = begin(traceparent, self.sampler)
            tape.trace_id, tape.span_id, tape.sampled = ids.trace_id, ids.span_id, ids.sampled
            if traceparent is not None:
                tape.parent = (traceparent, tracestate or "")
            trace = [(b"traceparent", ids.traceparent)]
            # The client's state belongs to its trace: with an invalid traceparent there is none to continue.
            state = tracestate if ids.child else None
            if self.owner_entry is not None:
                state = upstream_tracestate(state, self.owner_entry)
            if state is not None:
                trace.append((b"tracestate", state.encode("latin-1")))
        # A body still arriving once its request holds an admission slot may not keep the slot by falling silent.
        silence = settings.timeouts.client_upload if route.name in self.admissions else None
        splices = provider is not None and settings.inject_usage and getattr(provider, "splices_usage", False)
        scan = BodyScan() if splices else None
        limit = settings.max_inspect_bytes if provider else 0
        try:
            body, more = await read_body(receive, limit, settings.max_request_bytes, silence, scan)
        except ClientGone:
            return
        except RequestTooLarge:
            await refuse_request(send, too_large(settings.max_request_bytes))
            return
        tape.body_read = now()
        tape.body = body
        tape.body_complete = more is None
        rewritten: bytes | Pieces | None = None
        if provider is not None and more is None and settings.inject_usage:
            if scan is not None and scan.fed:
                # Read as it arrived (``llmtap.relay.bodyread``): one body of megabytes holds no other stream up, and
                # goes upstream in pieces, the splice between them, never copied whole.
                found = scan.insertion()
                if found is not None:
                    rewritten, tape.strip_usage = spliced(body, *found), True
            elif isinstance(body, bytes):
                prepared = provider.prepare(body, inject_usage=True, path=inner_path)
                rewritten, tape.strip_usage = prepared.body, prepared.strip_usage
        self.inflight += 1
        if self.ledger is not None:
            self.ledger.in_flight(self.inflight)
        self._idle.clear()
        self._active[route.name] += 1
        self._stats_changed = True
        try:
            await self._relay(scope, receive, send, route, tape, headers, body, more, rewritten, trace, cycle)
        except _Truncated:
            # Returning without completing the response makes the server drop the connection, so
            # the client sees the same truncation the proxy saw.
            pass
        finally:
            if tape.end is None:
                tape.end = now()
            self._active[route.name] -= 1
            self._hand_over(tape)
            self.inflight -= 1
            if self.ledger is not None:
                self.ledger.in_flight(self.inflight)
            if not self.inflight:
                self._idle.set()

    def _target(self, url: str) -> bytes:
        """The request target of ``url`` exactly as httpx would send it (its path and query, percent-encoded and
        normalized), remembered: a relay sees the same few paths again and again."""
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= _TARGETS:
                self._targets.clear()
            target = self._targets[url] = httpx.URL(url).raw_path
        return target

    def _segment(self, tape: Tape) -> None:
        """The tape is full mid-stream: its reads leave now, so a long stream holds little here. What the channel
        cannot take, even without its bytes, becomes a hole in the stream (``Tape.punch``), sent ahead of what
        follows it once there is room: the stream keeps its record, partial."""
        shard = shard_of(tape.trace_id, tape.key, self._shards)
        if tape.hole_size:
            if not self.channel.send(tape.hole_message(), reserve=True, shard=shard):
                tape.punch(tape.segment_message())
                return
            tape.hole_sent()
        message = tape.segment_message()
        if not self._send(message, shard=shard):
            tape.punch(message)

    def _hand_over(self, tape: Tape) -> None:
        """The request is over: its tape goes to the telemetry side, or is counted as dropped.

        The end may use the channel's reserve: it holds a stream's last reads, where usage is reported.
        """
        shard = shard_of(tape.trace_id, tape.key, self._shards)
        if tape.hole_size and self.channel.send(tape.hole_message(), reserve=True, shard=shard):
            tape.hole_sent()
        seq = self._handed[shard] + 1
        if not self._send(tape.end_message(self.relay_id, seq), reserve=True, shard=shard):
            self.tapes_dropped += 1
            log.debug("telemetry behind: dropped the tape of %s %s", tape.method, tape.path)
        else:
            self._handed[shard] = seq
            if self.ledger is not None:
                self.ledger.handed(shard, seq)
        self._stats_changed = True
        if self._stats_due is not None:
            return  # a report is due in a moment: it carries this end too
        loop = asyncio.get_running_loop()
        wait = self._stats_at + STATS_SOON - loop.time()
        if wait > 0:
            self._stats_due = loop.call_later(wait, self._send_stats_due)
        else:
            self._send_stats()

    def _send_stats_due(self) -> None:
        self._stats_due = None
        self._send_stats()

    def _send(self, message: Raw, *, reserve: bool = False, shard: int = 0) -> bool:
        """Send a tape message; when the channel is full, send it again without the response bytes.

        The reads' times and sizes are a few bytes each: the telemetry side keeps the stream's timing
        exact and its record, and decodes only what it got (the stream counts as partial).
        """
        if self.channel.send(message, reserve=reserve, shard=shard):
            return True
        timing = without_bytes(message)
        return timing is not None and self.channel.send(timing, reserve=True, shard=shard)

    async def _relay(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: Route,
        tape: Tape,
        headers: list[tuple[bytes, bytes]],
        body: Body,
        more: AsyncIterator[bytes] | None,
        rewritten: bytes | Pieces | None,
        trace: list[tuple[bytes, bytes]] | None,
        cycle: Any = None,
    ) -> None:
        content: bytes | Pieces | AsyncIterator[bytes]
        if more is not None:
            content = prepend(body, more)
        else:
            content = rewritten if rewritten is not None else body
        client = self.upstreams.client(route)
        timeouts = client.timeout.as_dict()
        out_request_headers = request_headers(
            headers,
            trace=trace,
            body_changed=rewritten is not None,
            plain=tape.strip_usage,
            private=self.forward_private,
            objectives=self.forward_objectives,
        )
        url = upstream_url(route, scope.get("raw_path") or scope["path"].encode(), scope.get("query_string", b""))
        direct = self._direct.get(route.name, _UNKNOWN)
        if direct is _UNKNOWN:
            lean = self.upstreams.lean(route)
            direct = self._direct[route.name] = None if lean is None else (lean, lean.origin(route.upstream))
        request: httpx.Request | None = None
        target = b""
        if direct is not None:
            # llmtap's own client, called directly: no httpx ``Request`` or ``Response`` per request (issue 29).
            target = self._target(url)
        else:
            # Built directly, not by the client: its default headers (Accept, Accept-Encoding, User-Agent) would go
            # upstream although the client never sent them.
            whole = b"".join(content) if isinstance(content, tuple) else content  # httpx takes bytes or a stream
            request = httpx.Request(
                scope["method"], url, headers=out_request_headers, content=whole, extensions={"timeout": timeouts}
            )
        # Only once the body is read can disconnects be watched: both need ``receive``.
        task = asyncio.current_task()
        watch = _DisconnectWatch(receive, task, cycle) if more is None and task is not None else None
        response: Answer | _HttpxAnswer | None = None
        strip: UsageEventFilter | None = None
        inflater: Inflater | None = None
        pipe: Pipe | None = None
        started = False
        admission = self.admissions.get(route.name)
        admitted = sent = counted = False

        def leaving() -> None:
            # The request's head goes onto the upstream connection now, after any connect: the upstream sees the
            # requests in this order, and those already in flight, whichever relay wrote them, are ahead of it.
            nonlocal counted
            tape.written = now()
            tape.upstream_ahead = self.upstream_inflight.begin(route.upstream)
            counted = True

        try:
            if admission is not None:
                try:
                    await self._admit(admission, route.name)
                except QueueFull as exc:
                    await self._refuse(send, route, tape, exc.reason)
                    return
                admitted = True
            tape.admitted = now()
            tape.upstream_seq = self._upstream_seq = self._upstream_seq + 1
            sent = True
            tape.sent = now()
            try:
                if direct is not None:
                    lean, origin = direct
                    response = await lean.send(
                        origin, scope["method"], target, out_request_headers, content, timeouts, leaving
                    )
                else:
                    assert request is not None
                    leaving()  # httpx's pool says nothing of its connect: as it is handed the request
                    response = _HttpxAnswer(await client.send(request, stream=True))
            except httpx.TransportError as exc:
                if await upstream_failed(send, route, tape, exc):
                    self._bad_head_said(route, tape.error_message)
                return
            except RequestTooLarge:
                tape.fail("request_too_large", f"request body exceeds {self.settings.max_request_bytes} bytes")
                await refuse_request(send, too_large(self.settings.max_request_bytes))
                return
            except UploadStalled:
                # The slot goes back (``finally``); the upstream's half-sent request is dropped with its connection.
                quiet = self.settings.timeouts.client_upload
                tape.fail("upload_timeout", f"request body stalled for {quiet:g} s while holding an admission slot")
                if self.connections is not None:
                    self.connections.timed_out("upload", scope.get("client"))
                await refuse_request(
                    send, Refusal(408, "upload_timeout", f"request body stalled for {quiet:g} s; retry")
                )
                return
            tape.headers_at = now()
            if watch is None and task is not None:
                # A body streamed past the inspect limit has gone upstream by now: ``receive`` can be watched, so
                # a client that leaves (or is cut for reading nothing) stops this stream too.
                watch = _DisconnectWatch(receive, task, cycle)
            idle = self.settings.timeouts.idle
            if idle is not None:
                # The client reads the read timeout at every wait: from here on it bounds the silence between
                # two chunks, not the wait for the headers.
                timeouts["read"] = idle
            status = response.status_code
            why = unrelayable(status, response.headers)
            if why is not None:
                # Nothing of it goes on, and its connection is not trusted with another request.
                response.abandon()
                await bad_head(send, route, tape, why)
                self._bad_head_said(route, why)
                return
            tape.status_code = status
            raw_headers = response.headers
            tape.response_headers = raw_headers
            if tape.strip_usage and status < 300:
                # The filter reads SSE framing. The upstream was asked for an uncompressed body; one that
                # compresses anyway is decompressed here, and one the relay cannot read keeps its usage event.
                encoding = _content_encoding(raw_headers)
                if encoding is None:
                    strip = UsageEventFilter()
                elif decodable(encoding):
                    strip, inflater = UsageEventFilter(), Inflater(encoding, self.settings.max_inflate_bytes)
            out_headers = response_headers(
                raw_headers, body_changed=strip is not None, status=status, decoded=inflater is not None
            )
            if self.settings.server_timing:
                out_headers.append((TIMING_HEADER, server_timing(tape, queued=admission is not None)))
            await send({"type": "http.response.start", "status": status, "headers": out_headers})
            started = True
            pipeable = response.body if inflater is None and scope["method"] != "HEAD" else None
            if cycle is not None and pipeable is not None:
                # The body path in the upstream's read callback (``llmtap.relay.pipe``): no task step per chunk.
                pipe = Pipe(tape, cycle, strip, self._segment)
                strip = await pipe.run(pipeable, lambda: timeouts.get("read"))
            else:
                async for chunk in response.aiter_raw():
                    full = tape.read(now(), chunk)
                    if inflater is None:
                        out = chunk
                        if strip is not None:
                            out, strip = _strip(strip, chunk)
                        if out:
                            await send({"type": "http.response.body", "body": out, "more_body": True})
                    else:
                        first = True
                        for piece in inflater.feed(chunk):
                            if not first:
                                # One bounded piece per turn of the event loop: a read that inflates to gigabytes
                                # costs every other stream at most one piece's work between two of theirs.
                                await asyncio.sleep(0)
                            first = False
                            out = piece
                            if strip is not None:
                                out, strip = _strip(strip, piece)
                            if out:
                                await send({"type": "http.response.body", "body": out, "more_body": True})
                    tape.delivered(now())
                    if full:
                        self._segment(tape)
            tail = b""
            if inflater is not None:
                tail = inflater.flush()
                if strip is not None:
                    tail, strip = _strip(strip, tail)
            if strip is not None:
                end, _ = _strip(strip, None)
                tail += end
            tape.end = now()
            if admitted and admission is not None:
                # The upstream has answered in full: its slot is free before the last send, so a client that
                # asks again the moment its answer ends is never refused for its own finished request.
                admitted = False
                admission.release()
            surplus = await response.surplus()
            tape.surplus = surplus
            if watch is not None:
                watch.stop()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except asyncio.CancelledError:
            if watch is not None and watch.fired and task is not None:
                # Our own cancellation, caused by the client leaving: nothing to propagate.
                tape.fail("cancelled", cancelled=True)
                task.uncancel()
                return
            if not self.draining or task is None:
                tape.fail("cancelled", cancelled=True)
                raise
            # The server cancels what still runs at the drain deadline: the client sees the stream cut.
            tape.fail("shutdown", "cut at the drain deadline")
            task.uncancel()
            if started:
                await _cut(send, tape, pipe.strip if pipe is not None else strip)
            await send_json(send, 503, "shutting_down", "llmtap is shutting down; retry")
        except (ClientGone, ClientLeft, OSError) as exc:
            if isinstance(exc, OSError) and not started:
                raise
            tape.fail("cancelled", cancelled=True)
        except InflateLimit as exc:
            tape.fail("inflate_limit", str(exc))
            self.cuts["inflate_limit"] += 1
            self._said.warn(
                "inflate_limit",
                self.cuts["inflate_limit"],
                "cut a response from %s: it decompressed past max_inflate_bytes (%d)",
                route.upstream,
                self.settings.max_inflate_bytes,
            )
            await _cut(send, tape, pipe.strip if pipe is not None else strip)
        except zlib.error as exc:
            tape.fail("upstream_error", f"the upstream's compressed body is corrupt: {exc}")
            log.warning("upstream %s sent a corrupt compressed body: %s", route.upstream, exc)
            await _cut(send, tape, pipe.strip if pipe is not None else strip)
        except httpx.TimeoutException as exc:
            tape.fail("idle_timeout", "upstream stopped sending")
            if started:
                self.breaks.broke(route.name, route.upstream, tape, str(exc) or "upstream stopped sending")
                await _cut(send, tape, pipe.strip if pipe is not None else strip)
        except httpx.HTTPError as exc:
            tape.fail("upstream_closed" if started else "upstream_error", f"{type(exc).__name__}: {exc}")
            if started:
                self.breaks.broke(route.name, route.upstream, tape, f"{type(exc).__name__}: {exc}")
                await _cut(send, tape, pipe.strip if pipe is not None else strip)
            await send_json(send, 502, "upstream_error", f"upstream {route.upstream}: {type(exc).__name__}")
        finally:
            if watch is not None:
                watch.stop()
            if response is not None:
                # Closing the response closes the upstream connection mid-stream: the server sees the
                # client leave and stops generating. A cancellation cannot skip it (``aclose``).
                await response.aclose()
            if counted:
                self.upstream_inflight.end(route.upstream)
            if sent:
                if tape.end is None:
                    tape.end = now()
            if admitted and admission is not None:
                admission.release()

    def _bad_head_said(self, route: Route, why: str | None) -> None:
        """An upstream's response head was answered 502 (``llmtap.relay.heads``): logged, at most every 10 s."""
        self.bad_heads += 1
        self._said.warn(
            "bad_head", self.bad_heads, "upstream %s: a response head llmtap cannot relay (%s)", route.upstream, why
        )

    async def _admit(self, admission: Admission, route: str) -> None:
        """Wait in the route's line; the waiting count is a gauge while anyone waits."""
        if admission.free:
            await admission.acquire()
            return
        self._waiting[route] += 1
        self._stats_changed = True
        try:
            await admission.acquire()
        finally:
            self._waiting[route] -= 1
            self._stats_changed = True

    async def _refuse(self, send: Send, route: Route, tape: Tape, reason: str) -> None:
        """The line is full (or the wait too long): refuse with Retry-After; nothing went upstream."""
        tape.admitted = tape.end = now()
        status = route.queue_full_status
        tape.status_code = status
        why = "is full" if reason == "queue_full" else "wait passed its limit"
        tape.fail(reason, f"admission queue of route {route.name} {why}")
        await send_json(
            send,
            status,
            reason,
            f"llmtap: the admission queue for {route.upstream} {why}; retry later",
            [(b"retry-after", str(route.retry_after).encode())],
        )


async def _cut(send: Send, tape: Tape, strip: UsageEventFilter | None) -> NoReturn:
    """The stream broke after the headers went out: relay what the usage filter still holds, then end the
    client's response the same way, without a clean end. Not one byte the upstream sent is held back.
    """
    if strip is not None:
        held, _ = _strip(strip, None)
        if held:
            await send({"type": "http.response.body", "body": held, "more_body": True})
    tape.end = now()
    raise _Truncated


def _content_encoding(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The response body's Content-Encoding; None when it is not compressed (none given, or identity)."""
    for name, value in headers:
        if name.lower() == b"content-encoding":
            return None if value.strip().lower() in (b"", b"identity") else value
    return None


class _Truncated(Exception):
    """Raised past the relay so the server drops the connection and the client sees the truncation."""


class _DisconnectWatch:
    """Cancels the relay the moment the client disconnects, so the upstream request stops at once.

    uvicorn drops writes to a closed connection silently, so a failing ``send`` cannot be relied on. Under
    llmtap's listener the request's cycle carries a hook its ``connection_lost`` calls (``LOST_HOOK``): no task
    per request. Under another server a task waits on ``receive`` for the disconnect.
    """

    def __init__(self, receive: Receive, task: asyncio.Task[object], cycle: Any = None) -> None:
        self.fired = False
        self._stopped = False
        self._task = task
        self._cycle = cycle
        self._watcher: asyncio.Task[None] | None = None
        if cycle is not None:
            setattr(cycle, LOST_HOOK, self._lost)
            if cycle.disconnected:
                self._lost()
        else:
            self._watcher = asyncio.create_task(self._run(receive))

    def _lost(self) -> None:
        # After the last byte went out, the server also reports a disconnect: not a cancellation.
        if not self._stopped and not self.fired:
            self.fired = True
            self._task.cancel()

    async def _run(self, receive: Receive) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                self._lost()
                return

    def stop(self) -> None:
        """The response is complete (or failed); stop watching."""
        self._stopped = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self._cycle is not None:
            setattr(self._cycle, LOST_HOOK, None)


class _HttpxAnswer:
    """An ``httpx.Response`` (httpx's client, or a transport a test injected) as the relay reads an ``Answer``."""

    __slots__ = ("_response", "body", "headers", "status_code")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status_code = response.status_code
        self.headers = response.headers.raw
        #: The lean client's body when it is what answered (its read callback can take the parts), else None.
        self.body = response.extensions.get(PIPE)

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self._response.aiter_raw()

    async def surplus(self) -> int:
        return await close_if_surplus(self._response)

    def abandon(self) -> None:
        """httpx's pool decides what becomes of the connection (``aclose`` releases it)."""

    async def aclose(self) -> None:
        # Shielded: httpx's close may wait (httpcore's pool), and a cancellation must not skip it.
        await asyncio.shield(self._response.aclose())


#: ``ProxyApp._direct``'s mark for a route not looked at yet.
_UNKNOWN: Any = object()
#: Request targets ``ProxyApp._target`` remembers, past which it starts again.
_TARGETS = 1024


def create_app(
    settings: Settings,
    *,
    channel: Channel,
    transport: httpx.AsyncBaseTransport | None = None,
    shared: Table | None = None,
) -> ProxyApp:
    """The proxy application; its channel to the telemetry side, its upstream transport and the table the relays of
    the server share (``--workers``) are injected."""
    return ProxyApp(settings, channel=channel, transport=transport, shared=shared)
