"""Timings a server reports about one request, read and checked before llmtap trusts them.

Servers report phases in many shapes: vLLM's ``metrics`` and NIM's ``stats`` in milliseconds, Ollama's
durations in nanoseconds, TGI's response headers as integer milliseconds. These pure functions turn
them into ``ServerTiming`` seconds and refuse anything that cannot be a duration: a wrong type, a
negative, NaN or infinite value, an unknown unit, or a phase longer than the whole request took as the
proxy saw it. A refused field is named in ``ServerTiming.rejected`` (and returned) so that it can be
counted; it is never used, so a bad report falls back to what the proxy measured or estimated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from llmtap.types import ServerTiming

__all__ = [
    "MS",
    "NS",
    "PHASES",
    "TGI_HEADERS",
    "TOLERANCE_FRACTION",
    "TOLERANCE_S",
    "FieldMap",
    "from_body",
    "from_headers",
    "header_seconds",
    "seconds",
    "validate",
]

PHASES = ("queue", "prefill", "decode")

#: Units per second, the divisor that turns a reported value into seconds.
MS = 1e3
NS = 1e9

#: Which body field reports which phase, and in what unit: ``{phase: (field, units per second)}``.
FieldMap = Mapping[str, tuple[str, float]]

# A server measures inside the span the proxy measures (request sent to stream end), so its phases
# cannot be longer; the slack covers rounding (TGI truncates to whole ms) and clock granularity.
TOLERANCE_S = 0.010
TOLERANCE_FRACTION = 0.01

# TGI's non-streamed timing headers (router/src/server.rs: ``duration.as_millis().to_string()``).
TGI_QUEUE = "x-queue-time"
TGI_INFERENCE = "x-inference-time"
TGI_VALIDATION = "x-validation-time"
TGI_TOTAL = "x-total-time"
TGI_PER_TOKEN = "x-time-per-token"
TGI_HEADERS = (TGI_QUEUE, TGI_INFERENCE, TGI_VALIDATION, TGI_TOTAL, TGI_PER_TOKEN)
# Each TGI header is truncated to whole milliseconds on its own, so parts can overshoot the total by
# up to one millisecond each.
_TGI_ROUNDING_S = 0.003

# A number and an optional unit. A bare integer is TGI's milliseconds; every other form must say its
# unit. The units are those of Rust's ``Duration`` debug format (what TGI writes in its traces).
_HEADER_VALUE = re.compile(r"([0-9]+)(\.[0-9]+)?[ \t]*([a-zA-Zµμ]*)")
_HEADER_UNITS = {"ns": 1e9, "us": 1e6, "µs": 1e6, "μs": 1e6, "ms": 1e3, "s": 1.0}


def seconds(value: object, per_second: float) -> float | None:
    """``value`` in seconds when it is a finite non-negative JSON number, else None (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        result = value / per_second
    except OverflowError:  # an integer too large for a float
        return None
    return result if math.isfinite(result) and result >= 0.0 else None


def from_body(raw: object, fields: FieldMap) -> ServerTiming | None:
    """The phases a JSON object reports per ``fields``; None when it reports none of them (or is no object).

    A field that is present but unusable is named in ``rejected``; absent and null fields say nothing.
    """
    if not isinstance(raw, dict):
        return None
    phases: dict[str, float] = {}
    rejected: list[str] = []
    seen = False
    for phase, (key, per_second) in fields.items():
        value = raw.get(key)
        if value is None:
            continue
        seen = True
        parsed = seconds(value, per_second)
        if parsed is None:
            rejected.append(key)
        else:
            phases[phase] = parsed
    if not seen:
        return None
    return _timing(phases, rejected)


def header_seconds(value: str) -> float | None:
    """A timing header's value in seconds: a bare integer is milliseconds, else it needs a known unit."""
    match = _HEADER_VALUE.fullmatch(value.strip())
    if match is None:
        return None
    whole, fraction, unit = match.groups()
    if not unit:
        # TGI writes whole milliseconds; a bare decimal is no format it writes, so its unit is unknown.
        return None if fraction else seconds(float(whole), MS)
    per_second = _HEADER_UNITS.get(unit.lower())
    if per_second is None:
        return None
    return seconds(float(whole + (fraction or "")), per_second)


def from_headers(headers: Mapping[str, str]) -> tuple[ServerTiming | None, list[str]]:
    """TGI's queue time from a non-streamed response's headers, and the names of the headers refused.

    TGI reports validation, queue and inference (prefill and decode together, so neither alone) and
    their total; only the queue maps onto a phase. The others check it: a part longer than the total,
    or parts that add up past it, make the report inconsistent and every part is refused.
    """
    found = {name.lower(): value for name, value in headers.items() if name.lower() in TGI_HEADERS}
    values: dict[str, float] = {}
    rejected: list[str] = []
    for name in TGI_HEADERS:
        if name not in found:
            continue
        parsed = header_seconds(found[name])
        if parsed is None:
            rejected.append(name)
        else:
            values[name] = parsed
    total = values.get(TGI_TOTAL)
    parts = [name for name in (TGI_VALIDATION, TGI_QUEUE, TGI_INFERENCE) if name in values]
    if total is not None and parts:
        over = [name for name in parts if values[name] > total + _TGI_ROUNDING_S]
        if over or sum(values[name] for name in parts) > total + _TGI_ROUNDING_S:
            rejected.extend(parts)
            for name in parts:
                del values[name]
    inference, per_token = values.get(TGI_INFERENCE), values.get(TGI_PER_TOKEN)
    if inference is not None and per_token is not None and per_token > inference + _TGI_ROUNDING_S:
        rejected.append(TGI_PER_TOKEN)
    queue = values.get(TGI_QUEUE)
    return (None if queue is None else ServerTiming(queue=queue)), rejected


def validate(timing: ServerTiming, elapsed: float) -> tuple[ServerTiming, list[str]]:
    """Drop the phases that cannot be right for a request that took ``elapsed`` seconds upstream.

    Dropped: a wrong type, a negative, NaN or infinite value, a phase longer than ``elapsed`` (plus a
    small tolerance), and every phase when together they add up past it (which one is wrong cannot be
    told). Returns the clean timing, whose ``rejected`` lists every refusal so far (the provider's and
    these), and the names of the phases dropped here. An ``elapsed`` that is not a finite non-negative
    number bounds nothing: only the type and sign checks apply.
    """
    kept: dict[str, float] = {}
    dropped: list[str] = []
    for phase in PHASES:
        value = getattr(timing, phase)
        if value is None:
            continue
        parsed = seconds(value, 1.0)
        if parsed is None:
            dropped.append(phase)
        else:
            kept[phase] = parsed
    bound = seconds(elapsed, 1.0)
    if bound is not None:
        bound += TOLERANCE_S + TOLERANCE_FRACTION * bound
        for phase in [p for p, value in kept.items() if value > bound]:
            dropped.append(phase)
            del kept[phase]
        if sum(kept.values()) > bound:
            dropped.extend(kept)
            kept.clear()
    dropped.sort(key=PHASES.index)
    return _timing(kept, [*timing.rejected, *dropped]), dropped


def _timing(phases: Mapping[str, float], rejected: list[str]) -> ServerTiming:
    return ServerTiming(
        queue=phases.get("queue"), prefill=phases.get("prefill"), decode=phases.get("decode"), rejected=rejected
    )
