"""The live view's HTTP side, mounted on the admin listener: the page, its two assets, and ``/events``.

``/events`` is a server-sent event stream: ``hello`` once, then ``requests`` (new waterfalls, each
batch with the last request's ``id`` so a reconnecting ``EventSource`` resumes where it left off) and
``snapshot`` (the window's figures, about once a second). Snapshots are computed in a worker thread,
so a large window never stalls the admin listener's other requests. All of it is Starlette routes.

The page itself carries its first data: ``/`` embeds what the stream would send first (``hello``, the kept
requests and a snapshot) as a JSON data block, which the script draws before it opens the stream, after the
page's load. A page fetched once, by a headless screenshot say, shows the current figures and never waits
on the open stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Settings
from llmtap.telemetry.admin.access import Gate
from llmtap.telemetry.admin.live.window import HISTORY, SLOT, WINDOWS, Labels, LiveWindow
from llmtap.telemetry.recorder import Recorder
from llmtap.wire.lessons import LiveEntry

__all__ = ["LiveView", "embed", "recorder_labels"]

#: Seconds between snapshots while nothing happens, and the shortest gap after new requests.
SNAPSHOT_EVERY = 1.0
SNAPSHOT_SOON = 0.25
#: An event stream ends after this many seconds and the browser reconnects: a server that is told to
#: stop waits for open responses, so no stream may hold it for long.
STREAM_LIFETIME = 15.0
#: Requests a new stream that names no request it holds (neither ``after`` nor ``Last-Event-ID``) is sent first.
BACKLOG = 20
#: Milliseconds the browser waits before reconnecting.
RETRY_MS = 500
#: A snapshot computed this recently (seconds) is what every stream asking for the same window gets: its
#: cost is one computation per window, not one per open stream.
SHARE_FOR = 0.5
#: ``requests`` events go out on a shared clock of this period (seconds): bursts of requests go out together,
#: and every stream sends at the same instants, so they hold the same requests and share one encoding.
REQUESTS_EVERY = 0.25

_ASSETS = {
    "/": ("index.html", "text/html"),
    "/live.js": ("live.js", "text/javascript"),
    "/live.css": ("live.css", "text/css"),
}
# The page may talk to its own origin (the admin listener) and nothing else.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS = {
    "content-security-policy": _CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
#: Where ``index.html`` takes the page's first data.
_INITIAL = b"{{initial}}"
_STREAM_HEADERS = {"cache-control": "no-store", "x-accel-buffering": "no"}


def _window(name: str | None) -> float | None:
    """The window named by ``?window=`` (1m, 5m, 15m, all); 5 minutes when absent or unknown."""
    return dict(WINDOWS).get(name or "5m", 300.0)


def _event(kind: str, data: Any, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def embed(data: Any) -> bytes:
    """JSON safe inside the page's ``<script type="application/json">`` block: no ``<``, ``>`` or ``&`` in it
    (a route or model name is client text and could otherwise close the block)."""
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


def recorder_labels(recorder: Recorder) -> Labels:
    """Route, model and prompt version as the recorder's metrics label them: the page's series are ``/metrics``'
    series."""

    def labels(tl: Timeline, s: Summary) -> tuple[str, str, str]:
        req = tl.request
        model = req.model if req is not None and req.model else tl.response_model
        # The recorder's own bounds on model names and versions: a name it has seen maps to the same label
        # again, so this reads the label without counting anything twice.
        version = recorder.version_label(tl.prompt_version) if tl.prompt_version else ""
        return tl.route, recorder.model_label(model) if model else "", version

    return labels


class LiveView:
    """Serves the live view; subscribes its window to the recorder's finished requests."""

    def __init__(
        self,
        recorder: Recorder,
        settings: Settings,
        *,
        traces: bool | None = None,
        busy: bool = False,
        skip: Callable[[Timeline], bool] | None = None,
        gate: Gate | None = None,
    ) -> None:
        """``busy`` and ``skip`` as ``LiveWindow`` takes them: rates over busy time, requests left out; ``gate``:
        who may open ``/events`` (default: the settings' own)."""
        if traces is None:
            traces = settings.telemetry.traces_exporter != "none"
        slo = settings.slo.configured or any(r.slo for r in settings.routes)
        self.window = LiveWindow(
            recorder_labels(recorder),
            slo=slo,
            traces=traces,
            busy=busy,
            skip=skip,
            on_drop=recorder.live_samples_dropped,
        )
        siblings = recorder.siblings
        if siblings is not None and siblings.index != 0:
            # Another telemetry process: its requests go to the first one's window, the one the admin port serves.
            recorder.listeners.append(self._pass_on)
        else:
            recorder.listeners.append(self.window)
            recorder.live_entries = self.window.take
        self.recorder = recorder
        self.gate = gate or Gate(settings.admin)
        #: ``/events`` streams open now, and at most.
        self.streams = 0
        self.max_streams = settings.admin.max_event_streams
        # The snapshot event last computed per window: (when, the newest request it holds, its task); the
        # ``requests`` events encoded lately, by the id they follow: (the newest id in it, the event).
        self._snapshots: dict[float | None, tuple[float, int, asyncio.Future[bytes]]] = {}
        self._encoded: dict[int, tuple[int, bytes]] = {}
        self._assets = {
            path: (resources.files("llmtap.telemetry.admin.live").joinpath("static", name).read_bytes(), kind)
            for path, (name, kind) in _ASSETS.items()
        }

    def _pass_on(self, tl: Timeline, s: Summary) -> None:
        """A request this process recorded, to the live view of process 0 (the listener, on the recorder's thread)."""
        siblings = self.recorder.siblings
        entry = self.window.entry(tl, s)
        if siblings is not None and entry is not None:
            siblings.offer([LiveEntry(entry)], first_only=True)

    def close(self) -> None:
        """End the open event streams, so the admin listener can stop at once."""
        self.window.close()

    def routes(self) -> list[Route]:
        """The page, its assets and the event stream, as the admin application's routes (GET only)."""
        pages = [Route(path, self._asset, methods=["GET"]) for path in self._assets]
        return [*pages, Route("/events", self._events, methods=["GET"])]

    async def _asset(self, request: Request) -> Response:
        body, kind = self._assets[request.url.path]
        if request.url.path == "/":
            window = _window(request.query_params.get("window"))
            first = await asyncio.to_thread(self.first_data, window)
            body = body.replace(_INITIAL, embed(first))
        return Response(body, media_type=kind, headers=_PAGE_HEADERS)

    def _hello(self, window: float | None) -> dict[str, Any]:
        return {
            "windows": [name for name, _ in WINDOWS],
            "window": next((n for n, w in WINDOWS if w == window), "5m"),
            "slot": SLOT,
            "history": HISTORY,
            "slo": self.window.slo,
            "traces": self.window.traces,
        }

    def first_data(self, window: float | None) -> dict[str, Any]:
        """What a new stream sends first, for the page to carry: ``hello``, the kept requests, a snapshot."""
        return {
            "hello": self._hello(window),
            "requests": self.window.since(0),
            "snapshot": self.window.snapshot(window),
        }

    async def _events(self, request: Request) -> Response:
        refusal = self.gate.refusal(request, "the live view's event stream")
        if refusal is not None:
            self.recorder.count_admin(refusal.reason)
            auth = {"www-authenticate": "Bearer"} if refusal.status == 401 else None
            return PlainTextResponse(refusal.message + "\n", status_code=refusal.status, headers=auth)
        if self.streams >= self.max_streams:
            self.recorder.count_admin("event_streams")
            message = f"{self.streams} live view streams are open, admin_max_event_streams is {self.max_streams}\n"
            return PlainTextResponse(message, status_code=503, headers={"retry-after": "5"})
        window = _window(request.query_params.get("window"))
        # The page asks for requests after the last one it holds; a reconnecting EventSource says the same
        # in Last-Event-ID.
        after = request.query_params.get("after", "")
        resume = request.headers.get("last-event-id", "")
        if after.isdigit() or resume.isdigit():
            last = max(int(after) if after.isdigit() else 0, int(resume) if resume.isdigit() else 0)
        else:
            # A client that says nothing (not the page) starts from the newest few requests, not every kept
            # waterfall: hundreds of such streams would each cost a copy of them all.
            kept = self.window.since(0)
            last = kept[-BACKLOG - 1]["id"] if len(kept) > BACKLOG else 0
        # Counted from here until the response ends, however it ends (Starlette ends the stream, cancelling
        # the generator, when the browser leaves; a generator that never started has no ``finally``).
        self.streams += 1
        self.recorder.event_streams(1)
        return _Counted(self._stream(window, last), self._released, headers=_STREAM_HEADERS)

    def _released(self) -> None:
        self.streams -= 1
        self.recorder.event_streams(-1)

    async def _snapshot(self, window: float | None, covering: int) -> bytes:
        """The window's ``snapshot`` event, computed on a thread at most once per ``SHARE_FOR`` seconds, and
        always after the request ``covering`` (the newest the stream has sent), so a snapshot never lags the
        requests its stream has shown."""
        loop = asyncio.get_running_loop()
        found = self._snapshots.get(window)
        if found is None or loop.time() - found[0] >= SHARE_FOR or found[1] < covering:
            newest = self.window.latest()  # read before computing: the snapshot holds at least this request
            task = asyncio.ensure_future(asyncio.to_thread(lambda: _event("snapshot", self.window.snapshot(window))))
            found = self._snapshots[window] = (loop.time(), newest, task)
        # shield: one stream leaving must not cancel the computation the others wait for.
        return await asyncio.shield(found[2])

    def _requests(self, last: int) -> tuple[int, bytes]:
        """The ``requests`` event of the kept requests after ``last``, and the newest id (``last``: none).

        Streams that hold the same requests get the same encoded bytes: encoded once, not once per stream.
        """
        newest = self.window.latest()
        if newest <= last:
            return last, b""
        found = self._encoded.get(last)
        if found is not None and found[0] == newest:
            return found
        records = self.window.since(last)
        if not records:
            return last, b""
        newest = records[-1]["id"]
        if len(self._encoded) >= 16:
            self._encoded.clear()
        found = self._encoded[last] = (newest, _event("requests", records, newest))
        return found

    async def _stream(self, window: float | None, last: int) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        sub = self.window.subscribe(loop)
        wake = sub.event
        until = loop.time() + STREAM_LIFETIME
        try:
            yield f"retry: {RETRY_MS}\n\n".encode() + _event("hello", self._hello(window))
            next_snapshot = loop.time()
            while not self.window.closed and loop.time() < until:
                wake.clear()
                last, records = self._requests(last)
                if records:
                    yield records
                    next_snapshot = min(next_snapshot, loop.time() + SNAPSHOT_SOON)
                    # What comes meanwhile goes out in one event, at the next tick of the shared clock.
                    await asyncio.sleep(REQUESTS_EVERY - loop.time() % REQUESTS_EVERY)
                if loop.time() >= next_snapshot:
                    yield await self._snapshot(window, last)
                    next_snapshot = loop.time() + SNAPSHOT_EVERY
                timeout = max(min(next_snapshot, until) - loop.time(), 0.0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout)
        finally:
            self.window.unsubscribe(sub)


class _Counted(StreamingResponse):
    """An event stream that calls ``release`` once it ends, however it ends."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
