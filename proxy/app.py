"""The ASGI applications: the proxy itself (pure ASGI on the response path) and the admin listener."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import NoReturn

import httpx
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from proxy import tokens
from proxy.admission import Admission, QueueFull
from proxy.fingerprint import version_label
from proxy.forward import (
    TRACE_HEADERS,
    Router,
    Upstreams,
    close_if_surplus,
    request_headers,
    response_headers,
    upstream_url,
)
from proxy.guard import Refusal, check_request, check_route
from proxy.live import LiveView
from proxy.providers import provider_for
from proxy.providers.base import Provider
from proxy.providers.timing import from_headers
from proxy.settings import Route, Settings
from proxy.streaming import Tap
from proxy.telemetry.prometheus import CONTENT_TYPE, PrometheusReader
from proxy.telemetry.recorder import Recorder, Ticket
from proxy.timeline import Timeline, now
from proxy.types import Message, Receive, RequestInfo, Scope, Send

log = logging.getLogger("llmtap.proxy")

PROMPT_VERSION_HEADER = b"x-llmtap-prompt-version"
#: At shutdown, how long requests cancelled at the drain deadline get to hand over their records.
_SETTLE_SECONDS = 2.0


class ClientGone(Exception):
    """The client disconnected; the upstream request is cancelled."""


class RequestTooLarge(Exception):
    """The request body grew past ``max_request_bytes`` while it was being read."""


async def send_json(
    send: Send, status: int, error_type: str, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """An error of the proxy's own, in the OpenAI error shape most SDKs display."""
    body = json.dumps({"error": {"type": error_type, "message": message, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ProxyApp:
    """Relays any request to its route's upstream and records what the stream shows."""

    def __init__(
        self,
        settings: Settings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        self.settings = settings
        self.router = Router(settings.routes)
        self.upstreams = Upstreams(settings, transport)
        self.recorder = Recorder(settings, tracer_provider=tracer_provider, meter_provider=meter_provider)
        self.ready = False
        #: Set on SIGTERM: streams still running at the drain deadline are cut and recorded as ``shutdown``.
        self.draining = False
        #: Requests between arrival and the hand-over of their record to the recorder.
        self.inflight = 0
        self._idle = asyncio.Event()  # set while ``inflight`` is 0
        self._idle.set()
        #: The admission queue of each route that limits its concurrency.
        self.admissions = {
            r.name: Admission(r.max_concurrency, r.queue_limit, r.queue_timeout)
            for r in settings.routes
            if r.max_concurrency is not None
        }
        # Requests in flight to each upstream, and a sequence number: what the estimator replays.
        self._upstream_inflight: dict[str, int] = {}
        self._upstream_seq = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        await self.handle(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # Load the default encoding now: loading it lazily on the recorder thread would hold
                # the GIL for a few hundred ms while the first streams are being relayed.
                await asyncio.to_thread(tokens.get_encoding)
                self.ready = True
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.ready = False
                await self._settle()
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _settle(self) -> None:
        """Let requests the server just cancelled (drain deadline) hand their records to the recorder first."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_SETTLE_SECONDS):
                await self._idle.wait()

    def begin_drain(self) -> None:
        """SIGTERM: report not ready; streams in flight may finish until the server's drain deadline."""
        self.ready = False
        self.draining = True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (from another thread) until every request so far is recorded; True when done in time."""
        deadline = time.monotonic() + timeout
        while self.inflight:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return self.recorder.flush(max(deadline - time.monotonic(), 0.1))

    async def aclose(self) -> None:
        """Close the upstream pools and drain the recorder."""
        await self.upstreams.aclose()
        await asyncio.to_thread(self.recorder.close)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Relay one HTTP request."""
        received, wall = now(), time.time_ns()
        settings = self.settings
        refusal = check_request(
            scope, max_header_bytes=settings.max_header_bytes, max_request_bytes=settings.max_request_bytes
        )
        if refusal is not None:
            await _refuse_request(send, refusal)
            return
        path: str = scope["path"]
        route = self.router.match(path)
        if route is None:
            await send_json(send, 404, "no_route", f"no route for {path}")
            return
        refusal = check_route(scope.get("raw_path") or path.encode(), route)
        if refusal is not None:
            await _refuse_request(send, refusal)
            return
        method: str = scope["method"]
        inner_path = path[len(route.prefix) :] if route.strip_prefix and route.prefix != "/" else path
        provider = provider_for(method, inner_path)
        tl = Timeline(
            method=method,
            path=path,
            route=route.name,
            upstream=route.upstream,
            server_address=route.host,
            server_port=route.port,
            protocol=provider.name if provider else None,
            provider_name=route.provider or (provider.family if provider else "_OTHER"),
            received=received,
            received_wall_ns=wall,
        )
        headers: list[tuple[bytes, bytes]] = list(scope["headers"])
        for name, value in headers:
            if name.lower() == PROMPT_VERSION_HEADER:
                tl.prompt_version = version_label(value)
        try:
            body, more = await self._read_body(receive, settings.max_inspect_bytes if provider else 0)
        except ClientGone:
            return
        except RequestTooLarge:
            await _refuse_request(send, _too_large(settings.max_request_bytes))
            return
        tl.body_read = now()
        info: RequestInfo | None = None
        if provider is not None:
            if more is None:
                info = provider.inspect(body, inject_usage=self.settings.inject_usage, path=inner_path)
            else:
                info = provider.inspect(b"{}", inject_usage=False, path=inner_path)
                info.parse_error = "body_not_inspected"
            tl.request = info
        handle, trace_headers = self.recorder.start(tl, _text_headers(headers))
        ticket = self.recorder.gate.enter()
        self.inflight += 1
        self._idle.clear()
        try:
            await self._relay(
                scope, receive, send, route, provider, tl, info, headers, body, more, trace_headers, ticket
            )
        except _Truncated:
            # Returning without completing the response makes the server drop the connection, so
            # the client sees the same truncation the proxy saw.
            pass
        finally:
            if tl.end is None:
                tl.end = now()
            ticket.leave()
            self.recorder.finish(tl, handle)
            self.inflight -= 1
            if not self.inflight:
                self._idle.set()

    async def _read_body(self, receive: Receive, limit: int) -> tuple[bytes, AsyncIterator[bytes] | None]:
        """Read the body up to ``limit`` bytes; past it, return what was read and an iterator over the rest.

        A body past ``max_request_bytes`` (possible only without Content-Length) raises ``RequestTooLarge``,
        here or from the iterator while the rest streams upstream.
        """
        parts: list[bytes] = []
        size = 0
        most = self.settings.max_request_bytes
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            if chunk:
                parts.append(chunk)
                size += len(chunk)
                if size > most:
                    raise RequestTooLarge
            if not message.get("more_body", False):
                return b"".join(parts), None
            if size > limit:
                return b"".join(parts), _rest_of_body(receive, most - size)

    async def _relay(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: Route,
        provider: Provider | None,
        tl: Timeline,
        info: RequestInfo | None,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        more: AsyncIterator[bytes] | None,
        trace_headers: dict[str, str],
        ticket: Ticket,
    ) -> None:
        rewritten = info.rewritten_body if info is not None else None
        content: bytes | AsyncIterator[bytes]
        if more is not None:
            content = _prepend(body, more)
        else:
            content = rewritten if rewritten is not None else body
        client = self.upstreams.client(route)
        request = client.build_request(
            scope["method"],
            upstream_url(route, scope.get("raw_path") or scope["path"].encode(), scope.get("query_string", b"")),
            headers=request_headers(headers, trace=trace_headers, body_changed=rewritten is not None),
            content=content,
        )
        # Only once the body is read can disconnects be watched: both need ``receive``.
        task = asyncio.current_task()
        watch = _DisconnectWatch(receive, task) if more is None and task is not None else None
        response: httpx.Response | None = None
        tap: Tap | None = None
        started = False
        admission = self.admissions.get(route.name)
        admitted = sent = False
        try:
            if admission is not None:
                try:
                    await self._admit(admission, tl)
                except QueueFull as exc:
                    await self._refuse(send, route, tl, exc.reason)
                    return
                admitted = True
            tl.admitted = now()
            tl.upstream_seq = self._upstream_seq = self._upstream_seq + 1
            tl.upstream_ahead = self._upstream_inflight.get(route.upstream, 0)
            self._upstream_inflight[route.upstream] = tl.upstream_ahead + 1
            sent = True
            tl.sent = now()
            try:
                response = await client.send(request, stream=True)
            except httpx.TransportError as exc:
                await _upstream_failed(send, route, tl, exc)
                return
            except RequestTooLarge:
                tl.fail("request_too_large", f"request body exceeds {self.settings.max_request_bytes} bytes")
                await _refuse_request(send, _too_large(self.settings.max_request_bytes))
                return
            tl.headers = now()
            timeouts = self.settings.timeouts
            if timeouts.idle is not None:
                # httpcore reads the read timeout when the body starts: from here on it bounds the silence
                # between two chunks, not the wait for the headers.
                request.extensions["timeout"]["read"] = timeouts.idle
            tl.status_code = response.status_code
            if "x-queue-time" in response.headers:
                # TGI reports its queue time in headers (non-streamed responses).
                tl.server_timing, bad = from_headers(response.headers)
                tl.rejected_timings.extend(bad)
            tap = Tap(
                tl,
                provider,
                content_type=response.headers.get("content-type", ""),
                content_encoding=response.headers.get("content-encoding", ""),
                strip_usage=bool(info and info.strip_usage and response.status_code < 300),
                stream_requested=bool(info and info.stream),
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": response_headers(response.headers.raw, body_changed=tap.changes_body),
                }
            )
            started = True
            async for chunk in response.aiter_raw():
                out = tap.feed(chunk, now())
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if tl.first_content is not None:
                    ticket.leave()
            tail = tap.finish(now())
            tl.end = now()
            if response.status_code >= 400:
                tl.fail(tl.error_type or str(response.status_code))
            surplus = await close_if_surplus(response)
            if surplus:
                tl.fail("upstream_protocol_error", f"{surplus} bytes past the end of the response; connection closed")
            if watch is not None:
                watch.stop()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except asyncio.CancelledError:
            if watch is not None and watch.fired and task is not None:
                # Our own cancellation, caused by the client leaving: nothing to propagate.
                tl.fail("cancelled", cancelled=True)
                task.uncancel()
                return
            if not self.draining or task is None:
                tl.fail("cancelled", cancelled=True)
                raise
            # The server cancels what still runs at the drain deadline: the client sees the stream cut.
            tl.fail("shutdown", "cut at the drain deadline")
            task.uncancel()
            if started:
                await _cut(send, tl, tap)
            await send_json(send, 503, "shutting_down", "llmtap is shutting down; retry")
        except (ClientGone, OSError) as exc:
            if isinstance(exc, OSError) and not started:
                raise
            tl.fail("cancelled", cancelled=True)
        except httpx.TimeoutException:
            tl.fail("idle_timeout", "upstream stopped sending")
            if started:
                await _cut(send, tl, tap)
        except httpx.HTTPError as exc:
            tl.fail("upstream_closed" if started else "upstream_error", f"{type(exc).__name__}: {exc}")
            if started:
                await _cut(send, tl, tap)
            await send_json(send, 502, "upstream_error", f"upstream {route.upstream}: {type(exc).__name__}")
        finally:
            if watch is not None:
                watch.stop()
            if response is not None:
                # Closing the response closes the upstream connection mid-stream: the server sees the
                # client leave and stops generating. Shielded so a cancellation cannot skip it.
                await asyncio.shield(response.aclose())
            if sent:
                self._upstream_inflight[route.upstream] -= 1
                if tl.end is None:
                    tl.end = now()
            if admitted and admission is not None:
                admission.release()

    async def _admit(self, admission: Admission, tl: Timeline) -> None:
        """Wait in the route's line; the waiting count is a metric while anyone waits."""
        if admission.free:
            await admission.acquire()
            return
        self.recorder.queue_changed(tl.route, +1)
        try:
            await admission.acquire()
        finally:
            self.recorder.queue_changed(tl.route, -1)

    async def _refuse(self, send: Send, route: Route, tl: Timeline, reason: str) -> None:
        """The line is full (or the wait too long): refuse with Retry-After; nothing went upstream."""
        tl.admitted = tl.end = now()
        status = route.queue_full_status
        tl.status_code = status
        why = "is full" if reason == "queue_full" else "wait passed its limit"
        tl.fail(reason, f"admission queue of route {route.name} {why}")
        await send_json(
            send,
            status,
            reason,
            f"llmtap: the admission queue for {route.upstream} {why}; retry later",
            [(b"retry-after", str(route.retry_after).encode())],
        )


def _too_large(limit: int) -> Refusal:
    return Refusal(413, "request_too_large", f"request body exceeds {limit} bytes")


async def _refuse_request(send: Send, refusal: Refusal) -> None:
    """A request llmtap will not relay; nothing went upstream. The connection is closed after the answer."""
    await send_json(send, refusal.status, refusal.error_type, refusal.message, [(b"connection", b"close")])


async def _upstream_failed(send: Send, route: Route, tl: Timeline, exc: httpx.TransportError) -> None:
    """No response headers came: 502 when the upstream could not be reached or hung up, 504 when it was too slow.

    The body and the log say what failed (``certificate verify failed: self-signed certificate``), not
    only the exception's class.
    """
    what = type(exc).__name__
    detail = str(exc) or what
    if isinstance(exc, httpx.TimeoutException):
        kind = "connect_timeout" if isinstance(exc, httpx.ConnectTimeout) else "timeout"
        reason = f"{what}: {exc}" if str(exc) else what
        message = f"upstream {route.upstream} timed out ({reason})"
        tl.fail(kind, f"upstream timed out: {what}")
        log.warning("%s", message)
        await send_json(send, 504, "upstream_timeout", message)
    elif isinstance(exc, httpx.ConnectError):
        message = f"upstream {route.upstream} unreachable: {detail}"
        tl.fail("upstream_unreachable", detail)
        log.warning("%s", message)
        await send_json(send, 502, "upstream_unreachable", message)
    else:
        # Connected, but the connection broke (reset, closed) before any response.
        message = f"upstream {route.upstream} closed the connection: {detail}"
        tl.fail("upstream_closed", detail)
        log.warning("%s", message)
        await send_json(send, 502, "upstream_closed", message)


async def _cut(send: Send, tl: Timeline, tap: Tap | None) -> NoReturn:
    """The stream broke after the headers went out: relay what the tap still holds, then end the client's
    response the same way, without a clean end. Not one byte the upstream sent is held back.
    """
    if tap is not None:
        held = tap.finish(now())
        if held:
            await send({"type": "http.response.body", "body": held, "more_body": True})
    tl.end = now()
    raise _Truncated


class _Truncated(Exception):
    """Raised past the relay so the server drops the connection and the client sees the truncation."""


class _DisconnectWatch:
    """Cancels the relay the moment the client disconnects, so the upstream request stops at once.

    uvicorn drops writes to a closed connection silently, so a failing ``send`` cannot be relied on.
    """

    def __init__(self, receive: Receive, task: asyncio.Task[object]) -> None:
        self.fired = False
        self._stopped = False
        self._task = task
        self._watcher = asyncio.create_task(self._run(receive))

    async def _run(self, receive: Receive) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                # After the last byte went out, the server also reports a disconnect: not a cancellation.
                if not self._stopped:
                    self.fired = True
                    self._task.cancel()
                return

    def stop(self) -> None:
        """The response is complete (or failed); stop watching."""
        self._stopped = True
        self._watcher.cancel()


async def _rest_of_body(receive: Receive, room: int) -> AsyncIterator[bytes]:
    """The rest of a large body as it arrives; ``RequestTooLarge`` once it outgrows ``room`` bytes."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            room -= len(chunk)
            if room < 0:
                raise RequestTooLarge
            yield chunk
        if not message.get("more_body", False):
            return


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk


def _text_headers(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers if k.lower() in TRACE_HEADERS}


class AdminApp:
    """The admin listener: ``/metrics``, ``/healthz``, ``/readyz`` and the live view (``/``, ``/events``); read-only.

    The live view subscribes to the proxy's recorder here, so it sees every request recorded from now on;
    ``traces`` says whether trace ids lead anywhere (default: an OTLP or console span exporter is set).
    """

    def __init__(self, proxy: ProxyApp, prometheus: PrometheusReader | None, *, traces: bool | None = None) -> None:
        self.proxy = proxy
        self.prometheus = prometheus
        self.live = LiveView(proxy.recorder, proxy.settings, traces=traces)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].replace("lifespan.", "")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/metrics":
            # Rendered on a thread: a large page takes long enough to stall the relay's event loop; and,
            # like every telemetry thread, after requests waiting for their first content got it.
            text = (
                await asyncio.to_thread(self._render, self.prometheus)
                if self.prometheus is not None
                else "# prometheus endpoint disabled\n"
            )
            await _plain(send, 200, text.encode(), CONTENT_TYPE)
        elif path == "/healthz":
            await _plain(send, 200, b"ok\n")
        elif path == "/readyz":
            ready = self.proxy.ready
            await _plain(send, 200 if ready else 503, b"ready\n" if ready else b"not ready\n")
        elif self.live.serves(path):
            await self.live(scope, receive, send)
        else:
            await _plain(send, 404, b"not found\n")

    def _render(self, prometheus: PrometheusReader) -> str:
        self.proxy.recorder.gate.give_way()
        return prometheus.render()


async def _plain(send: Send, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
) -> ProxyApp:
    """The proxy application; providers and the upstream transport are injected, never global."""
    return ProxyApp(settings, transport=transport, tracer_provider=tracer_provider, meter_provider=meter_provider)
