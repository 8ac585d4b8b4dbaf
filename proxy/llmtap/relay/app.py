"""The relay's ASGI application: routing and composition. Each request routed is one ``Exchange``.

``ProxyApp`` checks a request (``llmtap.relay.guard``), picks its route and provider, and hands it to an
``Exchange`` (``llmtap.relay.exchange``), which owns it to the end. What lives as long as the relay is made here
once: the upstream pools (``llmtap.relay.forward``), the admission lines, the tape hand-over
(``llmtap.relay.handover``), the gauges (``llmtap.relay.gauges``) and the relay's life (``llmtap.relay.lifecycle``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from llmtap.config.types import Route, Settings
from llmtap.listener import CYCLE
from llmtap.providers import provider_for
from llmtap.relay.admission import Admission
from llmtap.relay.answers import refuse_request, send_json
from llmtap.relay.channel import Channel
from llmtap.relay.exchange import Exchange
from llmtap.relay.fingerprint import Fingerprints
from llmtap.relay.forward import Upstreams
from llmtap.relay.frame import relay_frame
from llmtap.relay.gauges import STATS_EVERY, Gauges
from llmtap.relay.guard import check_request, check_route
from llmtap.relay.handover import Handover
from llmtap.relay.lifecycle import Lifecycle
from llmtap.relay.shared import InFlight, Table, table_columns
from llmtap.types import Receive, Scope, Send
from llmtap.wire.ledger import Ledger, new_relay_id
from llmtap.wire.tracecontext import Sampler
from llmtap.wire.tracestate import entry

if TYPE_CHECKING:
    from llmtap.listener import ClientLimits

__all__ = [
    "STATS_EVERY",
    "ProxyApp",
    "Router",
    "create_app",
]


class Router:
    """Picks the route of a request path; the upstream host comes only from configuration."""

    def __init__(self, routes: tuple[Route, ...]) -> None:
        # Settings sorts routes longest prefix first.
        self.routes = routes

    def match(self, path: str) -> Route | None:
        """The route whose prefix is the longest one that ``path`` starts with, on a segment boundary."""
        for route in self.routes:
            prefix = route.prefix
            if prefix == "/" or path == prefix or path.startswith(prefix + "/"):
                return route
        return None


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
        shared: Table | None = None,
    ) -> None:
        self.settings = settings
        self.router = Router(settings.routes)
        self.upstreams = Upstreams(settings)
        #: Trace ids are made here; a disabled SDK means no spans, so the client's trace headers pass as sent.
        self.tracing = not settings.telemetry.sdk_disabled
        self.sampler = Sampler.from_env()
        #: This replica's ``tracestate`` entry (``llmtap.wire.tracestate``): the model server's span of a request then
        #: says which replica relayed it, wherever the server sends it. None: one replica, nothing to route.
        peer = settings.telemetry
        self.owner_entry = entry(peer.peer_address, peer.peer_token) if peer.peer_address and peer.peer_token else None
        #: The API keys' fingerprints, with the operator's secret, else the install's (read at the first key seen).
        self.keys_seen = Fingerprints(settings.attribution.key)
        # What the relays of the server count together (``--workers``; else this relay's own table).
        shared = shared if shared is not None else Table(table_columns(settings))
        #: The admission queue of each route that limits its concurrency (the server's, over every relay).
        self.admissions = {
            r.name: Admission(r.max_concurrency, r.queue_limit, r.queue_timeout, table=shared, route=r.name)
            for r in settings.routes
            if r.max_concurrency is not None
        }
        #: Requests in flight to each upstream (every relay's), and a sequence number: what the estimator replays.
        self.upstream_inflight = InFlight(shared)
        self.upstream_seqs = itertools.count(1)
        #: Each request's tape key.
        self.keys = itertools.count(1)
        #: This relay's random id, by which the telemetry side keeps its totals and its ends' numbers.
        self.relay_id = new_relay_id()
        self.gauges = Gauges(tuple(r.name for r in settings.routes), channel, self.relay_id)
        self.handover = Handover(channel, self.gauges, self.relay_id)
        self.lifecycle = Lifecycle(self.gauges, self.handover, self.upstreams)
        #: The Starlette application around the relay: what a server serves (``__call__`` is its call).
        self.frame = relay_frame(self._endpoint, startup=self.lifecycle.startup, shutdown=self.lifecycle.shutdown)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # An HTTP request straight to ``handle`` (what the frame would call it with, two coroutines fewer a request).
        if scope["type"] == "http":
            await self.handle(scope, receive, send)
        else:
            await self.frame(scope, receive, send)

    async def _endpoint(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The catch-all route: every HTTP request, raw ASGI."""
        if scope["type"] == "http":
            await self.handle(scope, receive, send)
        elif scope["type"] == "websocket":
            # A WebSocket upgrade (uvicorn hands those over as their own scope) is not relayed.
            await send({"type": "websocket.close", "code": 1008, "reason": "llmtap relays HTTP only"})

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Relay one HTTP request: refused, unrouted, or handed to its ``Exchange``."""
        # Taken out of the scope at once: the cycle refers to the scope, which need not refer back.
        cycle = (scope.get("extensions") or {}).pop(CYCLE, None)
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
        inner = path[len(route.prefix) :] if route.strip_prefix and route.prefix != "/" else path
        await Exchange(self, scope, receive, send, route, provider_for(scope["method"], inner), cycle).run()

    # What start-up (``llmtap.serve``), tests and tools read and set of the relay.

    @property
    def ready(self) -> bool:
        """Ready to relay: started, and not draining."""
        return self.lifecycle.ready

    @property
    def draining(self) -> bool:
        """SIGTERM came: streams still running at the drain deadline are cut and recorded as ``shutdown``."""
        return self.lifecycle.draining

    @property
    def inflight(self) -> int:
        """Requests between arrival and the hand-over of their tape."""
        return self.lifecycle.inflight

    @property
    def tapes_dropped(self) -> int:
        """Tapes that did not reach the telemetry side, in whole or in part."""
        return self.gauges.tapes_dropped

    @property
    def ledger(self) -> Ledger | None:
        """The ledger of the ends handed over, in the record journal's folder (``llmtap.serve.relay`` opens it)."""
        return self.handover.ledger

    @ledger.setter
    def ledger(self, ledger: Ledger | None) -> None:
        self.handover.ledger = ledger

    @property
    def connections(self) -> ClientLimits | None:
        """The server's counts of client connections cut or refused, reported beside the gauges."""
        return self.gauges.connections

    @connections.setter
    def connections(self, limits: ClientLimits | None) -> None:
        self.gauges.connections = limits

    def begin_drain(self) -> None:
        """SIGTERM: report not ready; streams in flight may finish until the server's drain deadline."""
        self.lifecycle.begin_drain()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (from another thread) until every request so far is recorded; True when done in time."""
        return self.lifecycle.flush(timeout)

    async def aclose(self) -> None:
        """Close the upstream pools and the channel (which drains a local recorder)."""
        await self.lifecycle.aclose()


def create_app(
    settings: Settings,
    *,
    channel: Channel,
    shared: Table | None = None,
) -> ProxyApp:
    """The proxy application; its channel to the telemetry side and the table the relays of the server share
    (``--workers``) are injected."""
    return ProxyApp(settings, channel=channel, shared=shared)
