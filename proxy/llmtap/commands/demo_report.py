"""What ``llmtap demo`` prints: the tables of its phases and its progress while they run.

Every column names its statistic (``p50``, ``share``, tokens/s "per stream" against "all streams") so
that no figure can be read as another; the legend says where each queue and prefill figure came from.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmtap.commands.demo import Progress
    from llmtap.commands.demo_workloads import PhaseResult, Workload

__all__ = ["ProgressLine", "render"]


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


#: The table's columns: a group label, the statistic, and the cell of one phase. Every cell names its
#: statistic in the second header line, so no figure reads as another (a total as a per-stream rate).
_COLUMNS: tuple[tuple[str, str, Callable[[PhaseResult], str]], ...] = (
    ("", "layout", lambda r: r.layout),
    ("TTFT", "p50", lambda r: _ms(r.ttft_p50)),
    ("", "p95", lambda r: _ms(r.ttft_p95)),
    ("ITL", "p50", lambda r: _ms(r.itl_p50)),
    ("", "p95", lambda r: _ms(r.itl_p95)),
    ("TPOT", "p50", lambda r: _ms(r.tpot_p50)),
    ("output tokens/s", "per stream p50", lambda r: _rate(r.stream_tokens_per_s_p50)),
    ("", "all streams", lambda r: _rate(r.output_tokens_per_s)),
    ("goodput", "req/s (met SLO)", lambda r: f"{r.goodput_per_s:.2f} ({r.slo_met_share:.0%})"),
    ("queue", "p50", lambda r: _ms(r.queue_p50)),
    ("prefill", "p50", lambda r: _ms(r.prefill_p50)),
    ("decode", "p50", lambda r: _ms(r.decode_p50)),
    ("cached", "share", lambda r: f"{r.cached_share:.0%}"),
)


def _table(rows: list[PhaseResult]) -> list[str]:
    """Two header lines (what, then which statistic), a rule, one line per phase."""
    cells = [[cell(r) for _, _, cell in _COLUMNS] for r in rows]
    widths = [max(len(stat), *(len(c[i]) for c in cells)) for i, (_, stat, _) in enumerate(_COLUMNS)]
    groups, i = [], 0
    while i < len(_COLUMNS):
        # A group label spans its column and the unlabelled ones after it.
        span = 1
        while i + span < len(_COLUMNS) and not _COLUMNS[i + span][0]:
            span += 1
        room = sum(widths[i : i + span]) + 2 * (span - 1)
        if len(_COLUMNS[i][0]) > room:
            widths[i + span - 1] += len(_COLUMNS[i][0]) - room
            room = len(_COLUMNS[i][0])
        groups.append(_COLUMNS[i][0].ljust(room))
        i += span
    stats = [stat for _, stat, _ in _COLUMNS]
    table = [groups, [x.ljust(w) for x, w in zip(stats, widths, strict=True)], ["-" * w for w in widths]]
    table += [[c.ljust(w) for c, w in zip(row, widths, strict=True)] for row in cells]
    return [("  " + "  ".join(row)).rstrip() for row in table]


#: What each source of a queue or prefill figure means.
_SOURCES = {
    "server": "reported by the server (its own span of the request, joined by llmtap)",
    "proxy": "measured here",
    "estimated": "inferred from the server's slots and what the proxy saw",
    "upstream_ttft": "request sent to first token, server queueing included",
}


def render(results: list[PhaseResult], workloads: list[Workload], verdicts: dict[str, str]) -> str:
    """The human-readable report: one table per workload, then ``llmtap compare``'s verdict for each."""
    lines: list[str] = []
    for w in workloads:
        rows = [r for r in results if r.workload == w.name]
        if not rows:
            continue
        slo = " ".join(f"{k} <= {_ms(v)}" for k, v in (("TTFT", w.slo.ttft), ("TPOT", w.slo.tpot)) if v is not None)
        lines.append(
            f"\n{w.name}: {w.fixed_tokens + w.variable_tokens} prompt tokens ({w.fixed_tokens} unchanging), "
            f"{w.output_tokens} output tokens, {w.requests} requests at concurrency {w.concurrency}; SLO {slo}"
        )
        lines += _table(rows)
    lines += _request_objectives(results, workloads)
    lines.append("")
    for w in workloads:
        if w.name in verdicts:
            lines.append(f"{w.name}: {verdicts[w.name]}")
    used = sorted({src for r in results for src in f"{r.queue_source},{r.prefill_source}".split(",") if src})
    sources = "; ".join(f"{src} = {_SOURCES.get(src, src)}" for src in used)
    legend = (
        "Figures are the proxy's own measurements: p50/p95 over requests, ITL over tokens. Output tokens/s per "
        "stream is one stream's decode rate (1/TPOT); all streams is every stream's output over the phase's wall "
        "time. Goodput counts the requests a second that met every SLO."
    ) + (f" Queue and prefill: {sources}." if sources else "")
    lines += ["", *textwrap.wrap(legend, 110)]
    return "\n".join(lines)


def _objective(o: dict[str, Any]) -> str:
    return f"{o['figure'].upper()} <= {_ms(o['limit'])}"


def _request_objectives(results: list[PhaseResult], workloads: list[Workload]) -> list[str]:
    """The requests' own objectives (``x-slo-*`` headers), met and violated, per route, layout and limit."""
    routes = {w.name: w.route for w in workloads}
    head = ("route", "layout", "objective", "met", "violated")
    rows = [
        (routes.get(r.workload, r.workload), r.layout, _objective(o), str(o["met"]), str(o["violated"]))
        for r in results
        for o in r.request_objectives
    ]
    if not rows:
        return []
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]
    rule = tuple("-" * w for w in widths)
    intro = (
        "Per-request objectives (x-slo-ttft-ms, x-slo-tpot-ms headers): every other request asks for a tight TTFT, "
        "the rest for limits no answer comes near; each request is judged alone, met or violated."
    )
    table = [
        ("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))).rstrip() for row in (head, rule, *rows)
    ]
    return ["", *textwrap.wrap(intro, 110), *table]


class ProgressLine:
    """Progress on stderr, from a phase's first second: on a terminal one line rewritten in place as each
    request starts and ends and every second, kept when the phase ends; else a line as each phase starts
    and ends (a log file or a CI console cannot rewrite a line: two lines a phase, not one a request).
    """

    def __init__(self, out: IO[str], *, interactive: bool) -> None:
        self.out, self.interactive = out, interactive
        self._open = False  # a rewritten line is showing and needs its newline
        self._seen: set[tuple[str, str]] = set()

    def __call__(self, p: Progress) -> None:
        """Show where the phase stands."""
        phase = f"{p.workload}, {p.layout}"
        first = (p.workload, p.layout) not in self._seen
        self._seen.add((p.workload, p.layout))
        if self.interactive and not p.finished:
            state = f"{p.started}/{p.requests} started, {p.done} done" if p.started else "warm-up request"
            self.out.write(f"\r\033[K{phase}: {state}, {p.seconds:.0f} s")
            self._open = True
        elif p.finished:
            # Each finished phase keeps its line, so a terminal ends with one line per phase.
            self.out.write("\r\033[K" if self._open else "")
            self._open = False
            self.out.write(f"{phase}: {p.done}/{p.requests} done in {p.seconds:.1f} s\n")
        elif first:
            self.out.write(f"{phase}: {p.requests} requests at concurrency {p.concurrency}, after one warm-up\n")
        else:
            return
        self.out.flush()

    def close(self) -> None:
        """End the rewritten line, so what follows starts on a line of its own."""
        if self._open:
            self.out.write("\n")
            self.out.flush()
            self._open = False
