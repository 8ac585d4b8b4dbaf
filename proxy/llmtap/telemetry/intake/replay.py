"""From tape to timeline: the telemetry side plays back what the relay recorded, read by read.

The relay hands over the request's head, its body up to the inspect limit, and every upstream read with
the moment it arrived and the moment it reached the client's socket (``llmtap.wire.messages``). Here the body is
inspected by its provider, the reads are decoded (SSE, NDJSON, JSON array, gzip) and turned into facts
exactly as if they were arriving now, at the times they really arrived: the same ``Tap`` the relay ran
before the split, now in the telemetry process. A stream is played back as its segments come, so a
long response never waits here whole.
"""

from __future__ import annotations

import logging
import math
import struct
from array import array

from llmtap.analysis.attribution import dimensions
from llmtap.analysis.cost import header_cost
from llmtap.analysis.objectives import parse_objective
from llmtap.analysis.timeline import KEEP_CHARS, Timeline
from llmtap.config.types import Route, Settings
from llmtap.labels import version_label
from llmtap.providers import PROVIDERS
from llmtap.providers.base import Provider
from llmtap.providers.timing import from_headers
from llmtap.telemetry.intake.tap import Tap
from llmtap.telemetry.sched import checkpoint
from llmtap.types import RequestInfo
from llmtap.wire.messages import Head, Reads, Tail

__all__ = ["Playback"]

log = logging.getLogger("llmtap.telemetry")

#: One read's time as the relay's arrays hold it (``array('d')``), and the bytes of one read's size (``array('l')``).
_TIME = struct.Struct(array("d").typecode)
_SIZE = struct.Struct(array("l").typecode)

_BY_NAME: dict[str, Provider] = {}
for _p in PROVIDERS:
    _BY_NAME.setdefault(_p.name, _p)


#: Providers found, by name, method and path (a request's are those of the last one nearly always; the path is
#: the client's, so the dict is emptied when full).
_FOUND: dict[tuple[str, str, str], Provider | None] = {}
MAX_FOUND = 1024
#: Each route's upstream host and port, by its name, beside the route they were read from (parsing the URL twice a
#: request cost about 3 µs).
_PLACES: dict[str, tuple[Route, str, int]] = {}
MAX_PLACES = 256


def provider_named(name: str | None, method: str, path: str) -> Provider | None:
    """The provider the relay matched (by its name, the path deciding between same-named ones)."""
    if name is None:
        return None
    key = (name, method, path)
    try:
        return _FOUND[key]
    except KeyError:
        pass
    found = _provider_named(name, method, path)
    if len(_FOUND) >= MAX_FOUND:
        _FOUND.clear()
    _FOUND[key] = found
    return found


def _provider_named(name: str, method: str, path: str) -> Provider | None:
    for provider in PROVIDERS:
        if provider.name == name and provider.matches(method, path):
            return provider
    return _BY_NAME.get(name)


def _place(route: Route) -> tuple[str, int]:
    """``route``'s upstream host and port, read once per route."""
    kept = _PLACES.get(route.name)
    if kept is None or kept[0] is not route:
        if len(_PLACES) >= MAX_PLACES:
            _PLACES.clear()
        kept = _PLACES[route.name] = (route, route.host, route.port)
    return kept[1], kept[2]


def relay_delays(times: array[float], delivered: array[float], out: array[float]) -> None:
    """Append each read's delay in the relay, arrival to the client's socket (reads never delivered: none)."""
    out.extend([d - t for t, d in zip(times, delivered, strict=True) if d == d])  # d != d: NaN, not delivered


def _timeline(head: Head, settings: Settings, route: Route | None, provider: Provider | None) -> Timeline:
    """A timeline for ``head``'s request: its request line, route and upstream, and when it was received."""
    host, port = _place(route) if route else ("", 0)
    return Timeline(
        method=head.method,
        path=head.path,
        route=head.route,
        upstream=route.upstream if route else "",
        server_address=host,
        server_port=port,
        protocol=provider.name if provider else None,
        provider_name=(route.provider if route and route.provider else None)
        or (provider.family if provider else "_OTHER"),
        received=head.received,
        received_wall_ns=head.received_wall_ns,
        # The output's text is kept only where a span may show it.
        keep_chars=KEEP_CHARS if settings.telemetry.capture_content or settings.content.on else 0,
    )


def _hex(big_endian: bytes, size: int) -> str:
    """An id's bytes as its ``size * 2`` hex digits at least: ``bytes.hex`` when it has ``size`` bytes (a third of
    the cost of going through an int), else the number padded with zeros, as an id of another length always was."""
    if len(big_endian) == size:
        return big_endian.hex()
    return format(int.from_bytes(big_endian, "big"), f"0{size * 2}x")


def _set_moments(tl: Timeline, head: Head, route: Route | None) -> None:
    """The head's prompt version, trace, span and record ids, sampling, and the relay's moments."""
    if head.prompt_version is not None:
        tl.prompt_version = version_label(head.prompt_version)
    elif route is not None:
        tl.prompt_version = route.prompt_version
    tl.trace_id = _hex(head.trace_id, 16)
    tl.span_id = _hex(head.span_id, 8)
    tl.record_id = _hex(head.record_id, 16)
    tl.sampled = head.sampled
    tl.parent = head.parent
    tl.body_read, tl.admitted, tl.sent, tl.headers = head.body_read, head.admitted, head.sent, head.headers_at
    tl.written = head.written
    tl.status_code = head.status_code
    tl.upstream_seq, tl.upstream_ahead = head.upstream_seq, head.upstream_ahead


def _request_info(head: Head, provider: Provider | None) -> RequestInfo | None:
    """What the provider reads from the request's body (an empty body's, marked, when the relay kept only part)."""
    if provider is None:
        return None
    if head.body_complete:
        info = provider.inspect(head.body, inject_usage=False, path=head.inner_path)
    else:
        info = provider.inspect(b"{}", inject_usage=False, path=head.inner_path)
        info.parse_error = "body_not_inspected"
    info.strip_usage = head.strip_usage
    return info


def _set_attribution(tl: Timeline, head: Head, info: RequestInfo | None) -> None:
    """Who sent the request (bounded dimensions) and the objectives it asked for."""
    attribution, key_fingerprint = head.attribution, head.key_fingerprint
    if attribution or key_fingerprint or (info is not None and info.end_user):
        tl.attribution, tl.attribution_dropped = dimensions(
            attribution, body_user=info.end_user if info else None, key_fingerprint=key_fingerprint
        )
    if attribution:
        tl.request_objective = parse_objective(attribution)


def _set_response_headers(tl: Timeline, head: Head) -> dict[str, str]:
    """The response's headers, lower-cased; the cost and server timings they state go into ``tl``."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.response_headers}
    tl.header_cost = header_cost(headers)
    if "x-queue-time" in headers:
        # TGI reports its queue time in headers (non-streamed responses).
        tl.server_timing, bad = from_headers(headers)
        tl.rejected_timings.extend(bad)
    return headers


class Playback:
    """One stream being played back: created from its head, fed its reads, finished with its tail."""

    __slots__ = ("_delivered_first", "_last_delivered", "_tap", "partial", "tl")

    def __init__(self, head: Head, settings: Settings, routes: dict[str, Route]) -> None:
        """The timeline of ``head``'s request, every field the head gives set once, in its order
        (``llmtap.wire.messages.Head``): the request line and route, the ids and moments, the request's body,
        who sent it, and the response's headers."""
        route = routes.get(head.route)
        provider = provider_named(head.protocol, head.method, head.inner_path)
        tl = _timeline(head, settings, route, provider)
        self.tl = tl
        _set_moments(tl, head, route)
        info = _request_info(head, provider)
        if info is not None:
            tl.request = info
        _set_attribution(tl, head, info)
        headers = _set_response_headers(tl, head)
        self._tap: Tap | None = None
        if head.status_code is not None:
            self._tap = Tap(
                tl,
                provider,
                content_type=headers.get("content-type", ""),
                content_encoding=headers.get("content-encoding", ""),
                stream_requested=bool(info and info.stream),
            )
        self._delivered_first = False
        self._last_delivered = False  # the last read so far reached the client's socket
        #: Some reads came without their bytes (the relay's channel was full): timing only.
        self.partial = False

    def feed(self, reads: Reads) -> None:
        """Play back a run of reads: times of arrival, of delivery, sizes, and the bytes themselves.

        A body parsed whole that came in one read, with its bytes, before any other (a short answer, head and
        body read at once) takes ``_feed_whole``: what ``feed_each`` would do to it, without its loop."""
        tap = self._tap
        if tap is None:
            return
        if len(reads.sizes) == _SIZE.size and _SIZE.unpack(reads.sizes)[0] == len(reads.data) and tap.whole_pending():
            self._feed_whole(tap, reads)
        else:
            self.feed_each(reads)

    def _feed_whole(self, tap: Tap, reads: Reads) -> None:
        """The one read of a body parsed whole, all its bytes here: its bytes to the tap; its delivery for the
        completion (the body is parsed only at the end, so no content came yet) and for the relay's delay. No
        ``checkpoint``: one read is a moment's work, and the worker looks once per message anyway."""
        (t,) = _TIME.unpack(reads.times)
        (delivered,) = _TIME.unpack(reads.delivered)
        tap.feed(reads.data, t)  # the read's size is its bytes' length: they came
        self._last_delivered = delivered == delivered  # not NaN: it reached the client's socket
        if self._last_delivered:
            self.tl.relay_delays.append(delivered - t)

    def feed_each(self, reads: Reads) -> None:
        """Play back a run of reads one by one (any run of reads; ``feed`` takes a shorter way for some)."""
        tap = self._tap
        if tap is None:
            return
        times, delivered, sizes, data = array("d"), array("d"), array("l"), reads.data
        times.frombytes(reads.times)
        delivered.frombytes(reads.delivered)
        sizes.frombytes(reads.sizes)
        tl = self.tl
        gap = not data and any(sizes)
        self.partial = self.partial or gap
        at = 0
        for i, t in enumerate(times):
            checkpoint()
            size = sizes[i]
            if gap:
                tap.skip(size, t)
            else:
                tap.feed(data[at : at + size], t)
            at += size
            if not self._delivered_first and tl.first_content is not None:
                self._delivered_first = True
                when = delivered[i]
                tl.first_content_delivered = when if not math.isnan(when) else None
            if tl.completed and not tl.completed_delivered:
                # The read that brought the protocol's last event: did it reach the client's socket?
                tl.completed_delivered = not math.isnan(delivered[i])
        self._last_delivered = not math.isnan(delivered[-1]) if len(delivered) else self._last_delivered
        relay_delays(times, delivered, tl.relay_delays)

    def skip(self, size: int, at: float) -> None:
        """Reads of ``size`` bytes in all, the last arriving at ``at``, that never came here (a hole): counted, the
        stream's decoding starts over after them, and the stream is partial."""
        self.partial = True
        if self._tap is not None:
            self._tap.skip(size, at)

    def finish(self, tail: Tail) -> Timeline:
        """The stream's end: the relay's own verdict applied after what the stream itself said."""
        end, error_type, cancelled, surplus = tail.end, tail.error_type, tail.cancelled, tail.surplus
        tl = self.tl
        if self._tap is not None:
            self._tap.finish(end if end is not None else tl.received)
        if tl.completed and not tl.completed_delivered and self._last_delivered:
            # Completed at the end (a whole body parsed, a last event flushed): its bytes were the last read.
            tl.completed_delivered = True
        tl.end = end
        tl.response_bytes = tail.response_bytes
        # The first failure wins: what the stream said, then what the relay saw, then the status code.
        if error_type is not None and not cancelled:
            tl.fail(error_type, tail.error_message)
        if tl.status_code is not None and tl.status_code >= 400:
            tl.fail(tl.error_type or str(tl.status_code))
        if surplus:
            tl.fail("upstream_protocol_error", f"{surplus} bytes past the end of the response; connection closed")
        if cancelled and not tl.completed_delivered:
            # A client that hangs up once it has the last event (many do, at [DONE]) got the whole answer.
            tl.fail("cancelled", cancelled=True)
        return tl
