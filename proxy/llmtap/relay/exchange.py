"""One request's exchange with its upstream: an object per request that owns what the request holds.

``ProxyApp`` routes a request and makes its ``Exchange``; ``Exchange.run`` walks it through, one short step
each: read the request (its head: attribution, the key's fingerprint, the trace; its body, the usage splice),
wait for admission, call the upstream, relay its head, relay its body (the pipe in the upstream's read callback,
or a loop over its parts, decompressed when the usage event must be cut out of a compressed stream), and end;
a short answer read whole (with its head, or its counted rest waited for) goes out in one write, head and body
(``llmtap.relay.oneshot``).
Whatever the way out (the end, a failure, the client leaving, the drain deadline), ``finally`` releases the
upstream answer and the admission slot, and the tape is handed over once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

from llmtap.compression import InflateLimit, Inflater, decodable
from llmtap.config.types import Route
from llmtap.errors import ClientGone, LlmtapError
from llmtap.listener import RECEIVED
from llmtap.providers import Provider
from llmtap.providers.bodyscan import BodyScan
from llmtap.providers.usage_filter import UsageEventFilter
from llmtap.relay.admission import Admission, QueueFull
from llmtap.relay.answers import bad_head, refuse_request, send_json, too_large, upstream_failed
from llmtap.relay.bodyread import (
    SCAN_FROM,
    Body,
    RequestTooLarge,
    UploadStalled,
    body_of,
    prepend,
    read_body,
    spliced,
)
from llmtap.relay.fingerprint import KEY_HEADERS
from llmtap.relay.forward import PRIVATE_PREFIX, response_headers
from llmtap.relay.guard import Refusal
from llmtap.relay.heads import unrelayable
from llmtap.relay.oneshot import REST_BYTES, REST_WAIT, head_of, write_whole
from llmtap.relay.pipe import Pipe
from llmtap.relay.strip import strip_part
from llmtap.relay.timing import HEADER as TIMING_HEADER, server_timing
from llmtap.relay.upstream import Answer, Pieces
from llmtap.relay.upstream.errors import ReadTimeout, UpstreamError, UpstreamTimeout
from llmtap.relay.watch import DisconnectWatch
from llmtap.types import OBJECTIVE_HEADERS, Receive, Scope, Send
from llmtap.wire.tape import Tape, now
from llmtap.wire.tracecontext import begin
from llmtap.wire.tracestate import upstream_tracestate

if TYPE_CHECKING:
    from llmtap.relay.app import ProxyApp
    from llmtap.relay.upstream.connection import Connection

__all__ = ["Exchange", "Truncated"]

log = logging.getLogger("llmtap.proxy")

PROMPT_VERSION_HEADER = b"x-llmtap-prompt-version"

#: A request's trace headers as they go upstream; None: tracing is off and the client's pass as sent.
Trace = list[tuple[bytes, bytes]] | None


class Truncated(LlmtapError):
    """Raised past the relay so the server drops the connection and the client sees the truncation."""


class Exchange:
    """One request from its arrival to the hand-over of its tape; ``run`` is the whole of it."""

    __slots__ = (
        "admission",
        "admitted",
        "answer",
        "app",
        "body",
        "cycle",
        "headers",
        "inflater",
        "more",
        "pipe",
        "provider",
        "receive",
        "rewritten",
        "route",
        "scope",
        "send",
        "sent",
        "started",
        "strip",
        "tape",
        "task",
        "timeouts",
        "trace",
        "watch",
    )

    def __init__(
        self,
        app: ProxyApp,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: Route,
        provider: Provider | None,
        cycle: Any = None,
    ) -> None:
        self.app = app
        self.scope = scope
        self.receive = receive
        self.send = send
        self.route = route
        self.provider = provider
        extensions = scope.get("extensions") or {}
        received = extensions.get(RECEIVED) or now()
        #: The server's request cycle (llmtap's listener; ``ProxyApp.handle`` took it out of the scope); None under
        #: another server.
        self.cycle = cycle
        path: str = scope["path"]
        inner = path[len(route.prefix) :] if route.strip_prefix and route.prefix != "/" else path
        self.tape = Tape(
            next(app.keys),
            method=scope["method"],
            path=path,
            inner_path=inner,
            route=route.name,
            protocol=provider.name if provider else None,
            received=received,
            received_wall_ns=time.time_ns() - round((now() - received) * 1e9),
        )
        self.headers: list[tuple[bytes, bytes]] = list(scope["headers"])
        self.trace: Trace = None
        self.body: Body = b""
        #: The rest of a body past the inspect limit, still to stream upstream; None: read whole.
        self.more: AsyncIterator[bytes] | None = None
        #: The body as it goes upstream when the usage splice changed it.
        self.rewritten: bytes | Pieces | None = None
        self.timeouts: dict[str, float | None] = {}
        self.admission: Admission | None = app.admissions.get(route.name)
        self.admitted = self.sent = self.started = False
        self.task: asyncio.Task[Any] | None = None
        self.watch: DisconnectWatch | None = None
        self.answer: Answer | None = None
        self.strip: UsageEventFilter | None = None
        self.inflater: Inflater | None = None
        self.pipe: Pipe | None = None

    async def run(self) -> None:
        """Relay the request; its tape is handed over once, however it ends."""
        self.trace = self._read_head()
        if not await self._read_body():
            return
        lifecycle = self.app.lifecycle
        lifecycle.begin(self.route.name)
        try:
            await self._relay()
        except Truncated:
            # Returning without completing the response makes the server drop the connection, so the client sees
            # the same truncation the proxy saw.
            pass
        finally:
            lifecycle.end(self.route.name, self.tape)

    # The request: what the relay reads of it, before anything goes upstream.

    def _read_head(self) -> Trace:
        """Read the headers llmtap acts on (attribution, the API key's fingerprint, trace context); the trace
        headers to send upstream."""
        tape, app = self.tape, self.app
        traceparent = tracestate = None
        for name, value in self.headers:
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
                tape.key_fingerprint = app.keys_seen.of(value)
            elif lowered == b"traceparent":
                traceparent = value.decode("latin-1")
            elif lowered == b"tracestate":
                # Several fields are one list (RFC 9110 section 5.3; W3C Trace Context section 3.3.1.1).
                part = value.decode("latin-1")
                tracestate = part if tracestate is None else f"{tracestate},{part}"
        return self._begin_trace(traceparent, tracestate) if app.tracing else None

    def _begin_trace(self, traceparent: str | None, tracestate: str | None) -> Trace:
        """This request's trace ids, continuing the client's trace when it sent a valid one."""
        tape, app = self.tape, self.app
        ids = begin(traceparent, app.sampler)
        tape.trace_id, tape.span_id, tape.sampled = ids.trace_id, ids.span_id, ids.sampled
        if traceparent is not None:
            tape.parent = (traceparent, tracestate or "")
        trace = [(b"traceparent", ids.traceparent)]
        # The client's state belongs to its trace: with an invalid traceparent there is none to continue.
        state = tracestate if ids.child else None
        if app.owner_entry is not None:
            state = upstream_tracestate(state, app.owner_entry)
        if state is not None:
            trace.append((b"tracestate", state.encode("latin-1")))
        return trace

    async def _read_body(self) -> bool:
        """Read the body as far as the relay must (all of it up to ``max_inspect_bytes``), and splice the usage
        request in; False when the request ended here (the client left, or the body is too large)."""
        settings, provider, tape = self.app.settings, self.provider, self.tape
        # A body still arriving once its request holds an admission slot may not keep the slot by falling silent.
        silence = settings.timeouts.client_upload if self.admission is not None else None
        scan = BodyScan() if provider is not None and settings.inject_usage and provider.splices_usage else None
        limit = settings.max_inspect_bytes if provider else 0
        # A body that came whole with its head, read as ``read_body`` would read it (nothing left to stream or scan).
        whole = None if self.cycle is None else body_of(self.cycle, min(limit, SCAN_FROM, settings.max_request_bytes))
        if whole is not None:
            self.body, self.more = whole, None
        else:
            try:
                self.body, self.more = await read_body(self.receive, limit, settings.max_request_bytes, silence, scan)
            except ClientGone:
                return False
            except RequestTooLarge:
                await refuse_request(self.send, too_large(settings.max_request_bytes))
                return False
        tape.body_read = now()
        tape.body = self.body
        tape.body_complete = self.more is None
        if provider is not None and self.more is None and settings.inject_usage:
            self._splice(provider, scan)
        return True

    def _splice(self, provider: Provider, scan: BodyScan | None) -> None:
        """Ask a stream for its usage: the body with ``include_usage`` spliced in, and the event to cut out."""
        tape, body = self.tape, self.body
        if scan is not None and scan.fed:
            # Read as it arrived (``llmtap.relay.bodyread``): one body of megabytes holds no other stream up, and goes
            # upstream in pieces, the splice between them, never copied whole.
            found = scan.insertion()
            if found is not None:
                self.rewritten, tape.strip_usage = spliced(body, *found), True
        elif isinstance(body, bytes):
            prepared = provider.prepare(body, inject_usage=True, path=tape.inner_path)
            self.rewritten, tape.strip_usage = prepared.body, prepared.strip_usage

    # The relay: admission, the upstream's head, its body, the end.

    async def _relay(self) -> None:
        """From admission to the response's end; every way out releases what the request holds."""
        self.task = _current_task(self.app.lifecycle.loop)
        # Only once the body is read can disconnects be watched: both need ``receive``.
        if self.more is None and self.task is not None:
            self.watch = DisconnectWatch(self.receive, self.task, self.cycle)
        try:
            admitted = self._let_in() if self.admission is None else await self._admit()
            if admitted and await self._call_upstream() and await self._start_response():
                await self._relay_body()
                await self._finish()
        except asyncio.CancelledError:
            if not await self._cancelled():
                raise
        except (ClientGone, OSError, InflateLimit, zlib.error, UpstreamError) as exc:
            if not await self._broke(exc):
                raise
        finally:
            self._release()

    async def _admit(self) -> bool:
        """Wait in the route's line, if it has one; False when refused (the line is full, or the wait too long)."""
        admission, gauges = self.admission, self.app.gauges
        if admission is not None:
            route = self.route.name
            try:
                if admission.free:
                    await admission.acquire()
                else:
                    # The waiting count is a gauge while anyone waits.
                    gauges.waiting[route] += 1
                    gauges.changed = True
                    try:
                        await admission.acquire()
                    finally:
                        gauges.waiting[route] -= 1
                        gauges.changed = True
            except QueueFull as exc:
                await self._refuse(exc.reason)
                return False
            self.admitted = True
        return self._let_in()

    def _let_in(self) -> bool:
        """Admitted (at once on a route without a line): the request goes upstream now."""
        tape = self.tape
        tape.admitted = now()
        tape.upstream_seq = next(self.app.upstream_seqs)
        self.sent = True
        tape.sent = now()
        return True

    async def _refuse(self, reason: str) -> None:
        """The line is full (or the wait too long): refuse with Retry-After; nothing went upstream."""
        tape, route = self.tape, self.route
        tape.admitted = tape.end = now()
        status = route.queue_full_status
        tape.status_code = status
        why = "is full" if reason == "queue_full" else "wait passed its limit"
        tape.fail(reason, f"admission queue of route {route.name} {why}")
        await send_json(
            self.send,
            status,
            reason,
            f"llmtap: the admission queue for {route.upstream} {why}; retry later",
            [(b"retry-after", str(route.retry_after).encode())],
        )

    async def _call_upstream(self) -> bool:
        """Send the request upstream and wait for the response's head; False when it ended without one."""
        app, route, tape = self.app, self.route, self.tape
        settings = app.settings
        t = settings.timeouts
        self.timeouts = {"connect": t.connect, "read": t.read, "write": t.write, "pool": t.pool}
        content: bytes | Pieces | AsyncIterator[bytes]
        if self.more is not None:
            content = prepend(self.body, self.more)
        else:
            content = self.rewritten if self.rewritten is not None else self.body
        try:
            self.answer = await app.upstreams.send(
                route,
                self.scope,
                self.headers,
                content,
                self.timeouts,
                # Called by the upstream client, not by this exchange: ``tape.written`` then says it was counted.
                partial(app.upstream_inflight.leaving, route.upstream, tape),
                trace=self.trace,
                body_changed=self.rewritten is not None,
                plain=tape.strip_usage,
            )
        except UpstreamError as exc:
            if await upstream_failed(self.send, route, tape, exc):
                app.gauges.bad_head(route.upstream, tape.error_message)
            return False
        except RequestTooLarge:
            tape.fail("request_too_large", f"request body exceeds {settings.max_request_bytes} bytes")
            await refuse_request(self.send, too_large(settings.max_request_bytes))
            return False
        except UploadStalled:
            await self._upload_stalled()
            return False
        tape.headers_at = now()
        return True

    async def _upload_stalled(self) -> None:
        """The body stalled while holding an admission slot: 408. The slot goes back (``finally``); the upstream's
        half-sent request is dropped with its connection."""
        quiet = self.app.settings.timeouts.client_upload
        self.tape.fail("upload_timeout", f"request body stalled for {quiet:g} s while holding an admission slot")
        connections = self.app.gauges.connections
        if connections is not None:
            connections.timed_out("upload", self.scope.get("client"))
        await refuse_request(self.send, Refusal(408, "upload_timeout", f"request body stalled for {quiet:g} s; retry"))

    async def _start_response(self) -> bool:
        """Relay the upstream's head, with the body path set up; False when nothing more is to relay: the answer
        went whole (``_whole``), or it cannot be relayed (a 502 went)."""
        answer, tape, route, app = self.answer, self.tape, self.route, self.app
        assert answer is not None
        if self.watch is None and self.task is not None:
            # A body streamed past the inspect limit has gone upstream by now: ``receive`` can be watched, so a
            # client that leaves (or is cut for reading nothing) stops this stream too.
            self.watch = DisconnectWatch(self.receive, self.task, self.cycle)
        idle = app.settings.timeouts.idle
        if idle is not None:
            # The client reads the read timeout at every wait: from here on it bounds the silence between two
            # chunks, not the wait for the headers.
            self.timeouts["read"] = idle
        status = answer.status_code
        why = unrelayable(status, answer.headers)
        if why is not None:
            # Nothing of it goes on, and its connection is not trusted with another request.
            answer.abandon()
            await bad_head(self.send, route, tape, why)
            app.gauges.bad_head(route.upstream, why)
            return False
        tape.status_code = status
        tape.response_headers = answer.headers
        if tape.strip_usage and status < 300:
            self._filter(answer.headers)
        out = response_headers(
            answer.headers, body_changed=self.strip is not None, status=status, decoded=self.inflater is not None
        )
        if app.settings.server_timing:
            out.append((TIMING_HEADER, server_timing(tape, queued=self.admission is not None)))
        if self.cycle is not None and self.strip is None and self.inflater is None and await self._whole(status, out):
            return False
        await self.send({"type": "http.response.start", "status": status, "headers": out})
        self.started = True
        return True

    async def _whole(self, status: int, out: list[tuple[bytes, bytes]]) -> bool:
        """A short answer read whole goes to the client in one write, head and body, and the response ends here
        (``llmtap.relay.oneshot``): read with its head, or its counted rest waited for (``_rest``); False: it
        takes the ordinary path."""
        conn = self.answer.connection if self.answer is not None else None
        if conn is None or conn.error is not None or (not conn.done and not await self._rest(conn)):
            return False
        parts = conn.parts
        size = len(parts[0]) if len(parts) == 1 else sum(map(len, parts))
        # Every field of ``out`` is writable: the answer's passed ``unrelayable``; the relay's Server-Timing is ASCII.
        whole = head_of(self.cycle, status, out, size, writable=True)
        if whole is None:
            return False
        tape = self.tape
        # Each upstream read stays a read of its own on the tape, as the pipe would have taken it.
        reads = tuple(parts) if len(parts) > 1 else None
        full = False
        body = conn.take_whole()
        if reads is not None:
            t = now()
            for part in reads:
                full = tape.read(t, part)
        elif body:
            full = tape.read(now(), body)
        self._answered()
        write_whole(self.cycle, whole, status, body)
        self.started = True
        tape.end = now()
        if body:
            for _ in reads or (body,):
                tape.delivered(tape.end)
            if full:
                self.app.handover.segment(tape)
        return True

    async def _rest(self, conn: Connection) -> bool:
        """Wait for the rest of a short counted body whose head came first (an upstream that writes its head and
        its body apart, as uvicorn does): True once it is all read, within ``REST_WAIT`` seconds (the relay's
        read timeout when shorter). False, nothing written yet, for a body not counted, past ``REST_BYTES``, a
        failure or a rest that is late: the ordinary path then relays it as it would have, the head at once."""
        left = conn.still_to_come()
        if left is None or left + sum(map(len, conn.parts)) > REST_BYTES:
            return False
        seconds = self.timeouts.get("read")
        bound = REST_WAIT if seconds is None else min(REST_WAIT, seconds)
        deadline = now() + bound
        try:
            while not conn.done and conn.error is None:
                await conn.wait_readable(max(deadline - now(), 0.0))
        except ReadTimeout:
            return False
        return conn.error is None

    def _filter(self, headers: list[tuple[bytes, bytes]]) -> None:
        """The usage event the relay asked for is cut out of the stream. The filter reads SSE framing: the
        upstream was asked for an uncompressed body; one that compresses anyway is decompressed here, and one
        the relay cannot read keeps its usage event."""
        encoding = _content_encoding(headers)
        if encoding is None:
            self.strip = UsageEventFilter()
        elif decodable(encoding):
            self.strip = UsageEventFilter()
            self.inflater = Inflater(encoding, self.app.settings.max_inflate_bytes)

    async def _relay_body(self) -> None:
        """The body, each part relayed the moment it arrives: through the pipe in the upstream's read callback
        when the server is llmtap's listener and the body goes as it came, else part by part."""
        answer = self.answer
        assert answer is not None
        pipeable = answer.connection if self.inflater is None and self.scope["method"] != "HEAD" else None
        if self.cycle is not None and pipeable is not None:
            # The body path in the upstream's read callback (``llmtap.relay.pipe``): no task step per chunk.
            self.pipe = Pipe(self.tape, self.cycle, self.strip, self.app.handover.segment)
            self.strip = await self.pipe.run(pipeable, self.timeouts)
            return
        async for chunk in answer.aiter_raw():
            full = self.tape.read(now(), chunk)
            if self.inflater is None:
                await self._send_part(chunk)
            else:
                await self._send_inflated(self.inflater, chunk)
            self.tape.delivered(now())
            if full:
                self.app.handover.segment(self.tape)

    async def _send_part(self, part: bytes) -> None:
        out = part
        if self.strip is not None:
            out, self.strip = strip_part(self.strip, part)
        if out:
            await self.send({"type": "http.response.body", "body": out, "more_body": True})

    async def _send_inflated(self, inflater: Inflater, chunk: bytes) -> None:
        first = True
        for piece in inflater.feed(chunk):
            if not first:
                # One bounded piece per turn of the event loop: a read that inflates to gigabytes costs every other
                # stream at most one piece's work between two of theirs.
                await asyncio.sleep(0)
            first = False
            await self._send_part(piece)

    async def _finish(self) -> None:
        """The upstream's answer is whole: what the filters still hold goes, then the response's end."""
        tail = b""
        if self.inflater is not None:
            tail = self.inflater.flush()
            if self.strip is not None:
                tail, self.strip = strip_part(self.strip, tail)
        if self.strip is not None:
            end, _ = strip_part(self.strip, None)
            tail += end
        self.tape.end = now()
        self._answered()
        await self.send({"type": "http.response.body", "body": tail, "more_body": False})

    def _answered(self) -> None:
        """The upstream has answered in full and the response's last byte is about to go: the slot and the watch
        are let go before it."""
        if self.admitted and self.admission is not None:
            # The slot is free before the last send, so a client that asks again the moment its answer ends is
            # never refused for its own finished request.
            self.admitted = False
            self.admission.release()
        answer, self.answer = self.answer, None  # released here, and only here
        assert answer is not None
        self.tape.surplus = answer.close()
        if self.watch is not None:
            # Before the last byte goes: the disconnect the server reports after it is not a cancellation.
            self.watch.stop()
            self.watch = None

    # The ways out.

    async def _cancelled(self) -> bool:
        """The task was cancelled: by the client leaving (nothing to propagate), by the server at the drain
        deadline (the client sees the stream cut, or a 503), or by anything else (False: the caller propagates)."""
        tape, task = self.tape, self.task
        if self.watch is not None and self.watch.fired and task is not None:
            tape.fail("cancelled", cancelled=True)
            task.uncancel()
            return True
        if not self.app.lifecycle.draining or task is None:
            tape.fail("cancelled", cancelled=True)
            return False
        tape.fail("shutdown", "cut at the drain deadline")
        task.uncancel()
        if self.started:
            await self._cut()
        await send_json(self.send, 503, "shutting_down", "llmtap is shutting down; retry")
        return True

    async def _broke(self, exc: BaseException) -> bool:
        """The exchange failed past its admission: the client left, the body could not be decompressed, or the
        upstream failed or fell silent. Once the head went out, the client's response is cut (``Truncated``).
        False: not the exchange's to answer (an OS error before the head went out), the caller propagates it."""
        tape, route, app = self.tape, self.route, self.app
        if isinstance(exc, ClientGone | OSError):
            if isinstance(exc, OSError) and not self.started:
                return False
            tape.fail("cancelled", cancelled=True)
        elif isinstance(exc, InflateLimit):
            tape.fail("inflate_limit", str(exc))
            app.gauges.inflate_cut(route.upstream, app.settings.max_inflate_bytes)
            await self._cut()
        elif isinstance(exc, zlib.error):
            tape.fail("upstream_error", f"the upstream's compressed body is corrupt: {exc}")
            log.warning("upstream %s sent a corrupt compressed body: %s", route.upstream, exc)
            await self._cut()
        elif isinstance(exc, UpstreamTimeout):
            tape.fail("idle_timeout", "upstream stopped sending")
            if self.started:
                app.gauges.breaks.broke(route.name, route.upstream, tape, str(exc) or "upstream stopped sending")
                await self._cut()
        else:
            assert isinstance(exc, UpstreamError)
            what = f"{exc.label}: {exc}"
            tape.fail("upstream_closed" if self.started else "upstream_error", what)
            if self.started:
                app.gauges.breaks.broke(route.name, route.upstream, tape, what)
                await self._cut()
            await send_json(self.send, 502, "upstream_error", f"upstream {route.upstream}: {exc.label}")
        return True

    async def _cut(self) -> NoReturn:
        """The stream broke after the headers went out: relay what the usage filter still holds, then end the
        client's response the same way, without a clean end. Not one byte the upstream sent is held back."""
        strip = self.pipe.strip if self.pipe is not None else self.strip
        if strip is not None:
            held, _ = strip_part(strip, None)
            if held:
                await self.send({"type": "http.response.body", "body": held, "more_body": True})
        self.tape.end = now()
        raise Truncated

    def _release(self) -> None:
        """Whatever the way out: the watch stops, the upstream's answer is released, the slot goes back."""
        if self.watch is not None:
            self.watch.stop()
        if self.answer is not None:
            # Closing the answer closes the upstream connection mid-stream: the server sees the client leave and
            # stops generating. Nothing here waits, so a cancellation cannot skip it.
            self.answer.close()
        if self.tape.written is not None:
            self.app.upstream_inflight.end(self.route.upstream)
        if self.sent and self.tape.end is None:
            self.tape.end = now()
        if self.admitted and self.admission is not None:
            self.admission.release()


def _current_task(loop: asyncio.AbstractEventLoop | None) -> asyncio.Task[Any] | None:
    """The task running this exchange: asked of the relay's loop when it is known (no lookup of the running loop,
    a system call under Python 3.11), else as ``asyncio.current_task`` finds it."""
    task = asyncio.current_task(loop) if loop is not None else None
    return task if task is not None else asyncio.current_task()


def _content_encoding(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The response body's Content-Encoding; None when it is not compressed (none given, or identity)."""
    for name, value in headers:
        if name.lower() == b"content-encoding":
            return None if value.strip().lower() in (b"", b"identity") else value
    return None
