"""The demo's workloads: the course's two request shapes, agreed before measuring, each phase's figures, and the
prompts each request sends (the variable part first, or the unchanging part first)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmtap.analysis.stats import quantile
from llmtap.analysis.summary import Summary, slo_outcome
from llmtap.analysis.timeline import OK, Timeline
from llmtap.config.types import SLO
from llmtap.simulator.text import Vocabulary

__all__ = [
    "FIXED_FIRST",
    "LOOSE_OBJECTIVE",
    "VARIABLE_FIRST",
    "PhaseResult",
    "Workload",
    "default_workloads",
    "messages",
    "objective_headers",
    "phase_result",
]

VARIABLE_FIRST, FIXED_FIRST = "variable-first", "fixed-first"
#: The per-request objective every other request asks for: limits no simulated answer comes near, on any machine.
LOOSE_OBJECTIVE = {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "1000"}


@dataclass(frozen=True, slots=True)
class Workload:
    """One request shape, agreed before measuring: prompt parts, output length, load and SLOs."""

    name: str
    route: str
    profile: str
    fixed_tokens: int
    variable_tokens: int
    output_tokens: int
    requests: int
    concurrency: int
    slo: SLO
    #: The tight TTFT (ms) every other request asks for by its ``x-slo-ttft-ms`` header: between what the simulator
    #: takes for an uncached prompt and a cached one, so which requests miss it shows what caching buys.
    request_ttft_ms: int = 300


def default_workloads(requests: int | None = None, concurrency: int | None = None) -> list[Workload]:
    """The course's two workloads (support assistant, code completion), with optional load overrides."""
    return [
        Workload(
            name="support assistant",
            route="support",
            profile="support",
            fixed_tokens=5250,
            variable_tokens=950,
            output_tokens=300,
            requests=requests or 8,
            concurrency=concurrency or 4,
            # The course's objectives: the percentile that counts, for the shape it holds for.
            slo=SLO(ttft=0.5, tpot=0.030, e2e=None, percentile=0.95, shape="long_prompt"),
            # ~780 ms uncached, ~120 ms with the unchanging part cached.
            request_ttft_ms=300,
        ),
        Workload(
            name="code completion",
            route="code",
            profile="code",
            fixed_tokens=120,
            variable_tokens=80,
            output_tokens=64,
            requests=requests or 16,
            concurrency=concurrency or 4,
            slo=SLO(ttft=0.1, tpot=0.015, e2e=None, percentile=0.99, shape="short_prompt"),
            # ~27 ms uncached, ~18 ms cached: a limit some requests of either layout miss.
            request_ttft_ms=20,
        ),
    ]


@dataclass(slots=True)
class PhaseResult:
    """The figures of one workload in one prompt layout, all from the proxy's own measurements."""

    workload: str
    layout: str
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    itl_p50: float | None = None
    itl_p95: float | None = None
    tpot_p50: float | None = None
    #: One stream's decode rate, output tokens per second after the first token (1 / TPOT): p50 over requests.
    stream_tokens_per_s_p50: float | None = None
    #: Output tokens of all streams together over the phase's wall time (at the workload's concurrency).
    output_tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    goodput_per_s: float = 0.0
    slo_met_share: float = 0.0
    queue_p50: float | None = None
    queue_source: str = ""
    prefill_p50: float | None = None
    prefill_source: str = ""
    decode_p50: float | None = None
    cached_share: float = 0.0
    input_tokens_p50: float | None = None
    output_tokens_p50: float | None = None
    #: The requests' own objectives (``x-slo-*`` headers), one entry per figure and limit asked for: ``{"figure":
    #: "ttft", "limit": 0.3, "met": 2, "violated": 2}``, TTFT first, the tighter limit first.
    request_objectives: list[dict[str, Any]] = field(default_factory=list)


def objective_headers(w: Workload, index: int) -> dict[str, str]:
    """The per-request objective of a phase's request ``index``: a tight TTFT for even ones, loose limits else."""
    return {"x-slo-ttft-ms": str(w.request_ttft_ms)} if index % 2 == 0 else dict(LOOSE_OBJECTIVE)


def request_objective_counts(rows: list[tuple[Timeline, Summary]]) -> list[dict[str, Any]]:
    """How many requests met and violated each objective they asked for, by figure and limit."""
    counts: dict[tuple[str, float], dict[str, int]] = {}
    for tl, s in rows:
        limits = tl.request_objective.limits() if tl.request_objective is not None else {}
        for figure, outcome in s.request_outcomes.items():
            if figure in limits:
                tally = counts.setdefault((figure, limits[figure]), {"met": 0, "violated": 0})
                tally[outcome] = tally.get(outcome, 0) + 1
    order = sorted(counts, key=lambda k: (k[0] != "ttft", k[0], k[1]))
    return [{"figure": f, "limit": limit, **counts[(f, limit)]} for f, limit in order]


def phase_result(w: Workload, layout: str, rows: list[tuple[Timeline, Summary]], seconds: float) -> PhaseResult:
    """Aggregate the summaries of one phase; goodput against the workload's own SLOs."""
    r = PhaseResult(workload=w.name, layout=layout, requests=len(rows), seconds=seconds)
    ok = [s for tl, s in rows if tl.outcome == OK]
    r.errors = len(rows) - len(ok)
    r.ttft_p50 = quantile([s.ttft for s in ok if s.ttft is not None], 0.5)
    r.ttft_p95 = quantile([s.ttft for s in ok if s.ttft is not None], 0.95)
    itl = [x for s in ok for x in s.itl_per_token]
    r.itl_p50, r.itl_p95 = quantile(itl, 0.5), quantile(itl, 0.95)
    r.tpot_p50 = quantile([s.tpot for s in ok if s.tpot is not None], 0.5)
    r.stream_tokens_per_s_p50 = quantile([1 / s.tpot for s in ok if s.tpot], 0.5)
    out = sum(s.output_tokens or 0 for s in ok)
    good = sum(1 for tl, s in rows if slo_outcome(tl, s, w.slo) == "met")
    if seconds > 0:
        r.output_tokens_per_s = out / seconds
        r.requests_per_s = len(ok) / seconds
        r.goodput_per_s = good / seconds
    r.slo_met_share = good / len(rows) if rows else 0.0
    r.queue_p50 = quantile([s.queue for s in ok if s.queue is not None], 0.5)
    r.queue_source = ",".join(sorted({s.queue_source for s in ok if s.queue is not None}))
    r.prefill_p50 = quantile([s.prefill for s in ok if s.prefill is not None], 0.5)
    r.prefill_source = ",".join(sorted({s.prefill_source for s in ok if s.prefill is not None}))
    r.decode_p50 = quantile([s.decode for s in ok if s.decode is not None], 0.5)
    inputs = sum(s.input_tokens or 0 for s in ok)
    r.cached_share = sum(s.cache_read_tokens or 0 for s in ok) / inputs if inputs else 0.0
    r.input_tokens_p50 = quantile([float(s.input_tokens) for s in ok if s.input_tokens is not None], 0.5)
    r.output_tokens_p50 = quantile([float(s.output_tokens) for s in ok if s.output_tokens is not None], 0.5)
    r.request_objectives = request_objective_counts(rows)
    return r


def messages(w: Workload, layout: str, index: int, vocab: Vocabulary) -> list[dict[str, str]]:
    fixed = "".join(vocab.generate(f"{w.route}:fixed", w.fixed_tokens))
    variable = "".join(vocab.generate(f"{w.route}:request:{index}", w.variable_tokens))
    first, second = (fixed, variable) if layout == FIXED_FIRST else (variable, fixed)
    return [{"role": "system", "content": first}, {"role": "user", "content": second}]
