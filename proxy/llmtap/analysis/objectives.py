"""Per-request objectives: the latency a caller asks for one request, and whether the request met it.

A caller names its own targets in request headers, by the names the Gateway API Inference Extension reads
(https://gateway-api-inference-extension.sigs.k8s.io/, "SLO-aware routing"): ``x-slo-ttft-ms`` (time to first
token) and ``x-slo-tpot-ms`` (time per output token), each a number of milliseconds. These are not the
percentile objectives of ``routes[].slo`` (``llmtap.analysis.slo``), which judge a route's tail over many
requests: a per-request objective judges one request, ``met`` or ``violated``, each figure on its own.

How one request is judged, figure by figure:

- a request that failed or was cancelled ``violated`` every objective it carried (as goodput counts it);
- TTFT: the stream's TTFT against the limit; a non-streamed answer has no TTFT (it arrives whole), so its TTFT
  objective is not judged;
- TPOT: the request's TPOT against the limit; a successful answer of one content chunk has no TPOT and
  ``met`` it (as ``routes[].slo`` judges it: one token cannot be slow per token).

A header's value is a plain decimal number of milliseconds, greater than 0 and at most ``MAX_MS`` (one hour).
Anything else (not a number, negative, zero, ``NaN``, ``1e9``, a limit of days) is ignored and counted, and the
request goes on as if it had not been sent; a header given twice keeps its first value. Pure functions: the
relay passes the raw headers on, the telemetry process reads them here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from llmtap.types import OBJECTIVE_HEADERS

__all__ = [
    "FIGURES",
    "HEADERS",
    "MAX_MS",
    "MET",
    "VIOLATED",
    "RequestObjective",
    "judge_request",
    "parse_objective",
]

#: The header of each figure (lower case, as the relay reads names).
HEADERS = OBJECTIVE_HEADERS
#: The figures a per-request objective can bound, in the order reports name them.
FIGURES = ("ttft", "tpot")
MET, VIOLATED = "met", "violated"
#: The largest limit taken, in milliseconds: past an hour a latency target is a mistake, not an objective.
MAX_MS = 3_600_000.0
_NUMBER = re.compile(r"[0-9]{1,10}(?:\.[0-9]{1,6})?")


@dataclass(slots=True)
class RequestObjective:
    """The limits one request asked for, in seconds (None: not asked), and the headers ignored as invalid."""

    ttft: float | None = None
    tpot: float | None = None
    #: The figures whose header was given but not a valid limit (one entry per ignored header).
    invalid: list[str] = field(default_factory=list)

    def limits(self) -> dict[str, float]:
        """Each figure asked for, by name."""
        return {f: v for f in FIGURES if (v := getattr(self, f)) is not None}


def _limit(raw: bytes) -> float | None:
    """The limit a header's value names, in seconds, or None when it is not a valid one."""
    text = raw.decode("latin-1").strip()
    if not _NUMBER.fullmatch(text):
        return None
    ms = float(text)
    if not 0.0 < ms <= MAX_MS:
        return None
    return ms / 1000.0


def parse_objective(headers: Iterable[tuple[bytes, bytes]]) -> RequestObjective | None:
    """The objective in a request's headers (lower-case names; others are passed over), or None when it has
    none, valid or not."""
    out: RequestObjective | None = None
    seen: set[str] = set()
    for name, raw in headers:
        figure = HEADERS.get(name)
        if figure is None or figure in seen:
            continue
        seen.add(figure)
        if out is None:
            out = RequestObjective()
        limit = _limit(raw)
        if limit is None:
            out.invalid.append(figure)
        else:
            setattr(out, figure, limit)
    return out


def judge_request(
    objective: RequestObjective | None, *, ok: bool, streamed: bool, ttft: float | None, tpot: float | None
) -> dict[str, str]:
    """Each figure the request asked for: ``met`` or ``violated`` (a figure that does not apply is left out)."""
    if objective is None:
        return {}
    out: dict[str, str] = {}
    for figure, limit in objective.limits().items():
        if not ok:
            out[figure] = VIOLATED
        elif figure == "ttft":
            if streamed:
                out[figure] = MET if ttft is not None and ttft <= limit else VIOLATED
        else:
            out[figure] = MET if tpot is None or tpot <= limit else VIOLATED
    return out
