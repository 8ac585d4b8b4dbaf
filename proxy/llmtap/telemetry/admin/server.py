"""The admin listener: a Starlette application of routes over the recorder.

``/metrics`` (the Prometheus exposition, rendered on a thread), ``/healthz``, ``/readyz`` (the relays are
connected and ready; ``?verbose`` adds whether each upstream takes a connection, ``llmtap.telemetry.fleet.reach``), the
live view (``llmtap.telemetry.admin.live``) and the one route that takes data in: ``POST /v1/traces``, an OTLP/HTTP
(protobuf) trace receiver for the upstream's own spans (``llmtap.telemetry.fleet.serverspans``). It runs where the
recorder runs: the telemetry process, or the proxy's own process when telemetry runs in it (tests, the demo,
embedding).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Sequence
from typing import Protocol

import httpx
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Admin, Settings
from llmtap.telemetry.admin.access import Gate
from llmtap.telemetry.admin.live import LiveView
from llmtap.telemetry.exposition.prometheus import (
    CONTENT_TYPE,
    OPENMETRICS_CONTENT_TYPE,
    PrometheusReader,
    merge_metrics,
    wants_openmetrics,
)
from llmtap.telemetry.fleet.peers import PEER_HEADER, split
from llmtap.telemetry.fleet.reach import Reach, verbose
from llmtap.telemetry.fleet.serverspans import (
    BadBody,
    decode,
    inflate,
    server_spans,
    span_count,
)
from llmtap.telemetry.fleet.siblings import by_process
from llmtap.telemetry.recorder import Recorder
from llmtap.types import Receive, Scope, Send

__all__ = ["AdminApp"]


class AdminSource(Protocol):
    """What the admin listener reads: the recorder, the settings, and whether the relay is ready."""

    @property
    def settings(self) -> Settings: ...

    @property
    def ready(self) -> bool: ...

    @property
    def recorder(self) -> Recorder | None: ...


class AdminApp:
    """The admin listener, a Starlette application: ``/metrics``, ``/healthz``, ``/readyz`` and the live view
    (``/``, its assets, ``/events``); read-only.

    It runs where the recorder runs: the telemetry process, or the proxy's own process when telemetry
    runs in it. The live view subscribes to the recorder here, so it sees every request recorded from
    now on; ``traces`` says whether trace ids lead anywhere (default: an OTLP or console span exporter is set).
    """

    def __init__(
        self,
        source: AdminSource,
        prometheus: PrometheusReader | None,
        *,
        traces: bool | None = None,
        peers: Sequence[str] = (),
        busy: bool = False,
        skip: Callable[[Timeline], bool] | None = None,
    ) -> None:
        recorder = source.recorder
        if recorder is None:
            raise ValueError("the admin listener needs the recorder: serve it where telemetry runs")
        self.proxy = source
        self.recorder = recorder
        self.prometheus = prometheus
        #: Who may use the span receiver and the event stream (``llmtap.telemetry.admin.access``).
        self.gate = Gate(source.settings.admin)
        # ``busy`` and ``skip`` are the live view's: rates over busy time, requests it leaves out.
        self.live = LiveView(recorder, source.settings, traces=traces, busy=busy, skip=skip, gate=self.gate)
        #: The admin sockets of the other telemetry processes, whose ``/metrics`` this one adds to its own.
        self.peers = tuple(peers)
        #: The routes' upstreams, checked for ``/readyz?verbose`` and once after start-up.
        self.reach = Reach(source.settings.routes)
        routes = [
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/healthz", self._healthz, methods=["GET"]),
            Route("/readyz", self._readyz, methods=["GET"]),
            Route("/v1/traces", self._traces, methods=["POST"]),
            *self.live.routes(),
        ]
        self.app = Starlette(routes=routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    async def _metrics(self, request: Request) -> Response:
        if self.prometheus is None:
            return PlainTextResponse("# prometheus endpoint disabled\n")
        # OpenMetrics (with exemplars) when the scraper asks for it; the pages of several telemetry processes
        # are added up in the format asked, each bucket keeping the newest exemplar any of them has.
        openmetrics = wants_openmetrics(request.headers.get("accept", ""))
        # Rendered (and merged) on a thread: a large page takes long enough to stall the event loop.
        text = await asyncio.to_thread(self.prometheus.render, openmetrics=openmetrics)
        if self.peers:
            others = await asyncio.gather(*(_peer_metrics(path, openmetrics) for path in self.peers))
            pages = [text, *(t for t in others if t is not None)]
            text = await asyncio.to_thread(merge_metrics, pages, openmetrics=openmetrics)
        return Response(text, headers={"content-type": OPENMETRICS_CONTENT_TYPE if openmetrics else CONTENT_TYPE})

    async def _traces(self, request: Request) -> Response:
        """OTLP/HTTP protobuf spans from the upstream: read within bounds, queued for the recorder's join."""
        try:
            passed = self._passed_by_peer(request)
        except BadBody as exc:
            self.recorder.count_rejected(exc.reason)
            return _status(_REFUSAL_STATUS[exc.reason], str(exc))
        # A replica's pass carries the replicas' token; anything else meets the admin listener's gate.
        refusal = None if passed else self.gate.refusal(request, "the span receiver")
        if refusal is not None:
            self.recorder.count_rejected(refusal.reason)
            return _status(refusal.status, refusal.message)
        limits = self.proxy.settings.admin
        try:
            media = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if media not in (_PROTOBUF, "application/protobuf"):
                raise BadBody("unsupported_type", f"content-type {media!r}: only {_PROTOBUF} is taken")
            body = await _read_bounded(request, limits.max_body_bytes)
            # A body another replica passed here is this replica's to keep: never passed on again.
            owner = None if passed else self._owner()
            encoding = request.headers.get("content-encoding")
            siblings = self.recorder.siblings
            processes = (siblings.index, siblings.count) if siblings is not None else None
            raw, mine, theirs, others = await asyncio.to_thread(_read_export, body, encoding, owner, limits, processes)
        except BadBody as exc:
            self.recorder.count_rejected(exc.reason)
            return _status(_REFUSAL_STATUS[exc.reason], str(exc))
        # The spans this replica keeps go to the join, and to the backend when their trace was relayed here
        # (``peers.Ownership``); spans another replica relayed go there (``peers``). Neither ever waits.
        if mine is not None and not self.recorder.submit_spans(server_spans(mine), mine, len(raw)):
            return _status(503, "telemetry queue full")  # the sender retries: forwarded then, not now
        for address, (export, count) in theirs.items():
            self.recorder.route(address, export, count)
        for index, (data, count) in others.items():
            self.recorder.pass_spans(index, data, count)
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type=_PROTOBUF)

    def _passed_by_peer(self, request: Request) -> bool:
        """Whether another replica passed this body here; a body marked so without the replicas' token is refused."""
        if PEER_HEADER not in request.headers:
            return False
        token = self.proxy.settings.telemetry.peer_token
        if token is None or not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
            raise BadBody("unauthorized", f"{PEER_HEADER} without the replicas' token")
        return True

    def _owner(self) -> tuple[str, str] | None:
        """This replica's address and the replicas' token, when spans are routed between replicas."""
        t = self.proxy.settings.telemetry
        if t.peer_address is None or t.peer_token is None:
            return None
        return t.peer_address, t.peer_token

    async def _healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def _readyz(self, request: Request) -> Response:
        # ``?verbose``: the upstreams' state too (``llmtap.telemetry.fleet.reach``), which does not decide readiness.
        found = await self.reach.check() if "verbose" in request.query_params else None
        ready = self.proxy.ready
        detail = getattr(self.proxy, "ready_detail", "")
        if found is not None:
            return PlainTextResponse(verbose(ready, detail, found), status_code=200 if ready else 503)
        text = ("ready" if ready else "not ready") + (f" ({detail})" if detail else "")
        return PlainTextResponse(text + "\n", status_code=200 if ready else 503)


def _read_export(
    body: bytes,
    encoding: str | None,
    owner: tuple[str, str] | None,
    limits: Admin,
    processes: tuple[int, int] | None = None,
) -> tuple[
    bytes,
    ExportTraceServiceRequest | None,
    dict[str, tuple[ExportTraceServiceRequest, int]],
    dict[int, tuple[bytes, int]],
]:
    """The body inflated (within ``limits``), the spans this process keeps (None: none), those other replicas
    own, by address, and, with ``processes`` (this one's index, their count), those another telemetry process of
    this replica recorded, by index (``siblings.by_process``)."""
    raw = inflate(
        body,
        encoding,
        max_body=limits.max_body_bytes,
        max_inflated=limits.max_inflated_bytes,
        max_ratio=limits.max_inflate_ratio,
    )
    request = decode(raw)
    theirs: dict[str, tuple[ExportTraceServiceRequest, int]] = {}
    if owner is None:
        mine = request if span_count(request) else None
    else:
        mine, theirs = split(request, *owner)
    others: dict[int, tuple[bytes, int]] = {}
    if processes is not None and mine is not None:
        mine, others = by_process(mine, *processes)
    return raw, mine, theirs, others


async def _read_bounded(request: Request, limit: int) -> bytes:
    """The request body, refused past ``limit`` bytes however it is framed."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BadBody("too_large", f"body of {length} bytes is over {limit}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise BadBody("too_large", f"body over {limit} bytes")
    return bytes(body)


#: OTLP/HTTP's status for each refusal; the body is a ``google.rpc.Status`` (OTLP spec, "Failures").
_REFUSAL_STATUS = {
    "bad_body": 400,
    "too_large": 413,
    "inflated_too_large": 413,
    "unsupported_type": 415,
    "unauthorized": 401,
}
_PROTOBUF = "application/x-protobuf"


def _status(code: int, message: str) -> Response:
    # google.rpc codes: 3 invalid argument, 7 permission denied, 14 unavailable, 16 unauthenticated.
    rpc = {503: 14, 401: 16, 403: 7}.get(code, 3)
    body = Status(code=rpc, message=message).SerializeToString()
    headers = {"retry-after": "1"} if code == 503 else {"www-authenticate": "Bearer"} if code == 401 else None
    return Response(body, status_code=code, media_type=_PROTOBUF, headers=headers)


async def _peer_metrics(path: str, openmetrics: bool) -> str | None:
    """Another telemetry process's ``/metrics`` (OpenMetrics when asked), or None when it does not answer (it is
    being restarted)."""
    headers = {"accept": OPENMETRICS_CONTENT_TYPE} if openmetrics else {}
    try:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), timeout=10.0) as client:
            answer = await client.get("http://telemetry/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    return answer.text if answer.status_code == 200 else None
