"""Request shapes and the objective each request is judged by.

A shape is a bounded class of requests by input and output tokens (``settings.Shape``, the ``shapes:``
section); the first class whose bounds hold names the request, and a request none takes, or whose input
is unknown, is ``other``. The names come from the configuration alone, so as a metric label they are a
fixed, small set. Pure functions: the recorder, the live view and ``llmtap slo`` share them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from llmtap.config.types import OTHER_SHAPE, SLO, Route, Shape

__all__ = ["classify", "configured_slo", "names", "needed", "objective"]


def _within(value: int, low: int | None, high: int | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def classify(shapes: Sequence[Shape], input_tokens: int | None, output_tokens: int | None) -> str:
    """The name of the first shape whose bounds hold the request's tokens, else ``other``.

    Output not known (a request that failed before any) counts as none: a bound on output then holds when
    its minimum is 0 or open."""
    if input_tokens is None:
        return OTHER_SHAPE
    out = output_tokens or 0
    for shape in shapes:
        if _within(input_tokens, shape.min_input_tokens, shape.max_input_tokens) and _within(
            out, shape.min_output_tokens, shape.max_output_tokens
        ):
            return shape.name
    return OTHER_SHAPE


def names(shapes: Sequence[Shape]) -> tuple[str, ...]:
    """Every value the shape attribute can take, ``other`` last."""
    return (*(s.name for s in shapes), OTHER_SHAPE)


#: The least requests any percentile is judged from.
MIN_REQUESTS = 3


def needed(percentile: float) -> int:
    """Requests a percentile needs before one of them lies past it: 20 for p95, 100 for p99."""
    return max(MIN_REQUESTS, math.ceil(round(1 / (1 - percentile), 6)))


#: The last objective asked about, kept beside its answer: every request asks of the same one or two (the global
#: ``slo``, its route's), and ``SLO.configured`` builds a dict of its limits each time (about 0.7 µs).
_LAST_CONFIGURED: tuple[SLO | None, bool] = (None, False)


def configured_slo(slo: SLO) -> bool:
    """``slo.configured``, remembered for the last objective asked about (frozen: its answer never changes)."""
    global _LAST_CONFIGURED
    last, answer = _LAST_CONFIGURED
    if last is not slo:
        answer = slo.configured
        _LAST_CONFIGURED = (slo, answer)
    return answer


def objective(route: Route | None, shape: str, default: SLO | None) -> SLO | None:
    """The objective a request of ``shape`` on ``route`` is judged by: the route's first for its shape, then
    the route's first for every shape, then the global ``slo``."""
    if route is not None:
        for candidate in route.slo:
            if candidate.shape == shape:
                return candidate
        for candidate in route.slo:
            if candidate.shape is None:
                return candidate
    return default if default is not None and configured_slo(default) else None
