"""Server spans across replicas: each goes to the replica that relayed its request, and on from there only.

With several replicas behind one Service, a model server exports its spans to one address, and each
span lands on whichever replica the connection reaches. The relay names its replica in the
``tracestate`` it sends upstream (``llmtap.wire.tracestate``), the server's span inherits it, and the receiver
(``split``) passes a span that names another replica to that replica's admin listener, once (a body
marked as a peer's is never passed on again), with the replicas' shared token. The owner joins it to the
request it holds (``serverspans.Join``) within the same wait as a span sent to it directly.

What reaches the traces backend is decided where the request was relayed (``Ownership``): a span of a
trace this process relayed goes on; one of a trace it did not waits, at most ``wait`` seconds, for its
request's tape (the telemetry queue may be behind), then is dropped and counted ``unowned``. So a span
from anyone else (a forged one, another tenant's server) never reaches the backend with llmtap's
credentials, nor does a span whose owner could not be told (a server that drops ``tracestate``) from a
replica that did not relay it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from llmtap.config.types import TelemetrySettings
from llmtap.telemetry.fleet.forward import Forwarder
from llmtap.wire.tracestate import KEY, owner

__all__ = [
    "MAX_KNOWN",
    "MAX_WAITING",
    "MAX_WAITING_BYTES",
    "PEER_HEADER",
    "Ownership",
    "partition",
    "peer_forwarder",
    "split",
]

#: The header that marks a body one replica passed to another (its spans are never passed on again), and
#: the credential that goes with it (``authorization: Bearer <peer token>``).
PEER_HEADER = "x-llmtap-peer"
#: Seconds one pass to another replica may take: a span later than the owner's wait is of no use there.
PEER_TIMEOUT = 2.0
#: Traces relayed here that are remembered (their spans may go to the backend), the newest; about 1.5 MB.
MAX_KNOWN = 16384
#: Spans of traces not known yet that wait for their request at most, and their bytes (as sent: a vLLM span is
#: about 1 KB, so the spans' count binds first); past either the oldest trace's go, ``unowned``.
MAX_WAITING = 8192
MAX_WAITING_BYTES = 16 << 20
#: A span of an unknown trace waits at least this long, however short the join's wait.
MIN_HOLD = 2.0

K = TypeVar("K", bound=Hashable)


def partition(
    request: ExportTraceServiceRequest, key: Callable[[Span], K]
) -> dict[K, tuple[ExportTraceServiceRequest, int]]:
    """``request``'s spans grouped by ``key``: one export per group, with each span's resource and scope, and
    its span count. A group that holds every span is equal to ``request``."""
    groups: dict[K, tuple[ExportTraceServiceRequest, int]] = {}
    for resource_spans in request.resource_spans:
        opened: dict[K, ResourceSpans] = {}
        for scope_spans in resource_spans.scope_spans:
            by: dict[K, list[Span]] = {}
            for span in scope_spans.spans:
                by.setdefault(key(span), []).append(span)
            for k, spans in by.items():
                export, n = groups.get(k) or (ExportTraceServiceRequest(), 0)
                out = opened.get(k)
                if out is None:
                    out = opened[k] = export.resource_spans.add()
                    out.resource.CopyFrom(resource_spans.resource)
                    out.schema_url = resource_spans.schema_url
                scope: ScopeSpans = out.scope_spans.add()
                scope.scope.CopyFrom(scope_spans.scope)
                scope.schema_url = scope_spans.schema_url
                scope.spans.extend(spans)
                groups[k] = (export, n + len(spans))
    return groups


def split(
    request: ExportTraceServiceRequest, address: str | None, token: str | None
) -> tuple[ExportTraceServiceRequest | None, dict[str, tuple[ExportTraceServiceRequest, int]]]:
    """The spans this replica keeps (None: none), and those another replica owns, by its address.

    A span is another replica's when its ``tracestate`` has an ``llmtap`` entry signed with ``token`` that
    names an address other than ``address``; any other span stays (its owner may be this replica).
    """

    def whose(span: Span) -> str | None:
        if address is None or token is None or KEY not in span.trace_state:
            return None
        found = owner(span.trace_state, token)
        return None if found == address else found

    groups = partition(request, whose)
    mine = groups.pop(None, None)
    return (mine[0] if mine is not None else None), groups  # type: ignore[return-value]


@dataclass(slots=True)
class Ownership:
    """The traces this process relayed, and the spans of traces it may yet learn it relayed; bounded.

    Used by one thread (the recorder's worker); time is passed in. ``count(n)`` counts spans dropped as
    ``unowned``.
    """

    wait: float
    count: Callable[[int], None]
    _known: dict[bytes, None] = field(default_factory=dict)
    _waiting: dict[bytes, tuple[float, ExportTraceServiceRequest, int, int]] = field(default_factory=dict)
    _waiting_spans: int = 0
    _waiting_bytes: int = 0

    @property
    def hold(self) -> float:
        """How long a span of an unknown trace waits for its request."""
        return max(self.wait, MIN_HOLD)

    def relayed(self, trace_id: str) -> tuple[ExportTraceServiceRequest, int] | None:
        """This process relayed ``trace_id`` (hex): spans of it that waited, to pass on now (and their count)."""
        key = bytes.fromhex(trace_id)
        if self._known.pop(key, 0) is not None and len(self._known) >= MAX_KNOWN:  # new, and no room: the oldest goes
            del self._known[next(iter(self._known))]
        self._known[key] = None
        found = self._waiting.pop(key, None)
        if found is None:
            return None
        self._waiting_spans -= found[2]
        self._waiting_bytes -= found[3]
        return found[1], found[2]

    def take(self, request: ExportTraceServiceRequest, now: float) -> tuple[ExportTraceServiceRequest, int] | None:
        """The spans of ``request`` whose trace this process relayed (and their count); the others wait."""
        groups = partition(request, lambda span: bytes(span.trace_id) in self._known)
        for trace, (export, n) in partition(groups.pop(False, (ExportTraceServiceRequest(), 0))[0], _trace).items():
            at, waiting, before, size = self._waiting.pop(trace, (now, ExportTraceServiceRequest(), 0, 0))
            waiting.MergeFrom(export)
            added = export.ByteSize()
            self._waiting[trace] = (at, waiting, before + n, size + added)
            self._waiting_spans += n
            self._waiting_bytes += added
        while self._waiting_spans > MAX_WAITING or self._waiting_bytes > MAX_WAITING_BYTES:
            self._drop(next(iter(self._waiting)))
        return groups.get(True)

    def due(self, now: float) -> None:
        """Spans whose trace stayed unknown past the wait: dropped, counted."""
        while self._waiting:
            trace, (at, _, _, _) = next(iter(self._waiting.items()))
            if now - at < self.hold:
                break
            self._drop(trace)

    def next_deadline(self) -> float | None:
        """When the oldest waiting span's wait ends, or None."""
        if not self._waiting:
            return None
        return next(iter(self._waiting.values()))[0] + self.hold

    def _drop(self, trace: bytes) -> None:
        _, _, n, size = self._waiting.pop(trace)
        self._waiting_spans -= n
        self._waiting_bytes -= size
        self.count(n)

    @property
    def waiting(self) -> int:
        """Spans waiting now."""
        return self._waiting_spans

    @property
    def waiting_bytes(self) -> int:
        """The bytes of the spans waiting now, as they came."""
        return self._waiting_bytes


def _trace(span: Span) -> bytes:
    return bytes(span.trace_id)


def peer_forwarder(t: TelemetrySettings, count: Callable[[str, int], None]) -> Forwarder | None:
    """The sender of spans to the replicas that own them, or None when this replica has no peers."""
    if t.peer_address is None or t.peer_token is None:
        return None
    headers = {
        "content-type": "application/x-protobuf",
        PEER_HEADER: "1",
        "authorization": f"Bearer {t.peer_token}",
    }
    client = httpx.Client(timeout=PEER_TIMEOUT, headers=headers)

    def send_to(body: bytes, address: str) -> None:
        host, _, port = address.rpartition(":")
        if ":" in host and not host.startswith("["):  # an IPv6 pod IP, as $(POD_IP) gives it
            host = f"[{host}]"
        answer = client.post(f"http://{host}:{port}/v1/traces", content=body)
        if answer.status_code != 200:
            raise RuntimeError(f"{address} answered {answer.status_code}")

    return Forwarder(None, count, close=client.close, send_to=send_to)
