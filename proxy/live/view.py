"""The live view's HTTP side, mounted on the admin listener: the page, its two assets, and ``/events``.

``/events`` is a server-sent event stream: ``hello`` once, then ``requests`` (new waterfalls, each
batch with the last request's ``id`` so a reconnecting ``EventSource`` resumes where it left off) and
``snapshot`` (the window's figures, about once a second). Snapshots are computed in a worker thread,
since the admin listener may share its event loop with the proxy's relay.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from proxy.live.window import HISTORY, SLOT, WINDOWS, Labels, LiveWindow
from proxy.settings import Settings
from proxy.summary import Summary
from proxy.telemetry.recorder import Recorder
from proxy.timeline import Timeline
from proxy.types import Receive, Scope, Send

#: Seconds between snapshots while nothing happens, and the shortest gap after new requests.
SNAPSHOT_EVERY = 1.0
SNAPSHOT_SOON = 0.25
#: An event stream ends after this many seconds and the browser reconnects: a server that is told to
#: stop waits for open responses, so no stream may hold it for long.
STREAM_LIFETIME = 15.0
#: Milliseconds the browser waits before reconnecting.
RETRY_MS = 500

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
_PAGE_HEADERS = [
    (b"content-security-policy", _CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
]


def _window(query: bytes) -> float | None:
    """The window named by ``?window=`` (1m, 5m, 15m, all); 5 minutes when absent or unknown."""
    name = parse_qs(query.decode("latin-1")).get("window", ["5m"])[0]
    return dict(WINDOWS).get(name, 300.0)


def _event(kind: str, data: Any, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def recorder_labels(recorder: Recorder) -> Labels:
    """Route and model as the recorder's metrics label them: the page's series are ``/metrics``' series."""

    def labels(tl: Timeline, s: Summary) -> tuple[str, str]:
        req = tl.request
        model = req.model if req is not None and req.model else tl.response_model
        # The recorder's own bound on model names: a name it has seen maps to the same label again,
        # so this reads the label without counting anything twice.
        return tl.route, recorder.model_label(model) if model else ""

    return labels


class LiveView:
    """Serves the live view; subscribes its window to the recorder's finished requests."""

    def __init__(self, recorder: Recorder, settings: Settings, *, traces: bool | None = None) -> None:
        if traces is None:
            traces = settings.telemetry.traces_exporter != "none"
        self.window = LiveWindow(recorder_labels(recorder), slo=settings.slo.configured, traces=traces)
        recorder.listeners.append(self.window)
        self._assets = {
            path: (resources.files("proxy.live").joinpath("static", name).read_bytes(), kind)
            for path, (name, kind) in _ASSETS.items()
        }

    def serves(self, path: str) -> bool:
        """True for the paths this view answers."""
        return path in self._assets or path == "/events"

    def close(self) -> None:
        """End the open event streams, so the admin listener can stop at once."""
        self.window.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "GET":
            await _respond(send, 405, b"read-only\n", "text/plain; charset=utf-8", [(b"allow", b"GET")])
            return
        path = scope["path"]
        if path == "/events":
            await self._events(scope, receive, send)
            return
        body, kind = self._assets[path]
        await _respond(send, 200, body, f"{kind}; charset=utf-8", _PAGE_HEADERS)

    async def _events(self, scope: Scope, receive: Receive, send: Send) -> None:
        window = _window(scope.get("query_string", b""))
        # The page asks for requests after the last one it holds; a reconnecting EventSource says the same
        # in Last-Event-ID.
        after = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("after", ["0"])[0]
        last = int(after) if after.isdigit() else 0
        for name, value in scope["headers"]:
            if name.lower() == b"last-event-id" and value.isdigit():
                last = max(last, int(value))
        loop = asyncio.get_running_loop()
        sub = self.window.subscribe(loop)
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch(receive, gone, sub.event))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-store"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            hello = {
                "windows": [name for name, _ in WINDOWS],
                "window": next((n for n, w in WINDOWS if w == window), "5m"),
                "slot": SLOT,
                "history": HISTORY,
                "slo": self.window.slo,
                "traces": self.window.traces,
            }
            await _body(send, f"retry: {RETRY_MS}\n\n".encode() + _event("hello", hello))
            await self._stream(send, window, last, sub.event, gone, loop.time() + STREAM_LIFETIME)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.window.unsubscribe(sub)
            watcher.cancel()

    async def _stream(
        self, send: Send, window: float | None, last: int, wake: asyncio.Event, gone: asyncio.Event, until: float
    ) -> None:
        loop = asyncio.get_running_loop()
        next_snapshot = loop.time()
        while not gone.is_set() and not self.window.closed and loop.time() < until:
            wake.clear()
            records = self.window.since(last)
            if records:
                last = records[-1]["id"]
                await _body(send, _event("requests", records, last))
                next_snapshot = min(next_snapshot, loop.time() + SNAPSHOT_SOON)
            if loop.time() >= next_snapshot:
                snapshot = await asyncio.to_thread(self.window.snapshot, window)
                await _body(send, _event("snapshot", snapshot))
                next_snapshot = loop.time() + SNAPSHOT_EVERY
            timeout = max(min(next_snapshot, until) - loop.time(), 0.0)
            try:
                await asyncio.wait_for(wake.wait(), timeout)
            except TimeoutError:
                pass


async def _watch(receive: Receive, gone: asyncio.Event, wake: asyncio.Event) -> None:
    """Notice the browser leaving (uvicorn drops writes to a closed connection silently)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            wake.set()
            return


async def _body(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _respond(send: Send, status: int, body: bytes, content_type: str, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type.encode()),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
