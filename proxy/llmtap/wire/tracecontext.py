"""W3C Trace Context in the relay: read the client's ``traceparent``, make ours, decide sampling, no SDK.

The relay must send ``traceparent`` upstream before the request leaves (a tracing server such as vLLM
nests its spans under it), but it runs no OpenTelemetry code: the ids are made here and the telemetry
process later writes the request's spans with exactly these ids. The sampling flag is decided as the
SDK's sampler named by ``OTEL_TRACES_SAMPLER`` would decide it (default ``parentbased_always_on``), so the
flag sent upstream and the telemetry side's decision agree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from llmtap.wire.tape import new_span_id, new_trace_id

__all__ = ["MAX_TRACEPARENT", "Sampler", "TraceIds", "begin", "parse_traceparent"]

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
#: The longest ``traceparent`` taken (the OpenTelemetry SDK's propagator ignores a longer one).
MAX_TRACEPARENT = 512
#: The SDK's ``TraceIdRatioBased`` compares the trace id's low 64 bits with ``round(rate * 2**64)``.
_LOW64 = (1 << 64) - 1


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """``(trace_id, parent_span_id, flags)`` of a W3C ``traceparent``, or None when it is not valid.

    W3C Trace Context, section 3.2: version ``ff`` is invalid, all-zero ids are invalid, and a version
    00 header has nothing after the flags; a later version may carry more, which is ignored.
    """
    if len(value) > MAX_TRACEPARENT:
        return None  # the telemetry side's SDK reads no longer one: a new trace, on both sides
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace, span, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace, 16), int(span, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(flags, 16)


@dataclass(frozen=True, slots=True)
class Sampler:
    """The sampling decision of the SDK sampler configured by ``OTEL_TRACES_SAMPLER`` (and ``_ARG``)."""

    #: Follow a valid parent's sampled flag (the ``parentbased_*`` samplers).
    parent_based: bool = True
    #: The ratio for a root (1.0: always on, 0.0: always off).
    ratio: float = 1.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Sampler:
        """The sampler the SDK would build from the environment; unknown names fall back to its default."""
        env = os.environ if env is None else env
        name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
        try:
            arg = min(max(float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0")), 0.0), 1.0)
        except ValueError:
            arg = 1.0
        return {
            "always_on": cls(False, 1.0),
            "always_off": cls(False, 0.0),
            "traceidratio": cls(False, arg),
            "parentbased_always_on": cls(True, 1.0),
            "parentbased_always_off": cls(True, 0.0),
            "parentbased_traceidratio": cls(True, arg),
        }.get(name, cls())

    def sampled(self, trace_id: int, parent_flags: int | None) -> bool:
        """Whether a request's spans are recorded: the parent's flag, or the ratio on the trace id."""
        if self.parent_based and parent_flags is not None:
            return bool(parent_flags & 1)
        if self.ratio >= 1.0:
            return True
        return (trace_id & _LOW64) < round(self.ratio * (_LOW64 + 1))


@dataclass(slots=True)
class TraceIds:
    """A request's trace: ids made in the relay, and the ``traceparent`` that goes upstream."""

    trace_id: int
    span_id: int
    sampled: bool
    #: Whether the client's ``traceparent`` was valid, making this request a child of its trace: only then
    #: does its ``tracestate`` go upstream (an invalid ``traceparent`` is treated as none).
    child: bool = False

    @property
    def traceparent(self) -> bytes:
        """The header value naming this request's root span as the upstream's parent (formatted as bytes at once: half
        the CPU of a ``str`` formatted and then encoded)."""
        return b"00-%032x-%016x-%s" % (self.trace_id, self.span_id, b"01" if self.sampled else b"00")


def begin(traceparent: str | None, sampler: Sampler) -> TraceIds:
    """A child of the client's trace when its ``traceparent`` is valid, else a new trace."""
    parent = parse_traceparent(traceparent) if traceparent else None
    if parent is None:
        trace_id = new_trace_id()
        return TraceIds(trace_id, new_span_id(), sampler.sampled(trace_id, None))
    trace_id, _, flags = parent
    return TraceIds(trace_id, new_span_id(), sampler.sampled(trace_id, flags), child=True)
