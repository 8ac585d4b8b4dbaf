"""Cost per request in ``llmtap compare`` and ``llmtap slo`` (issue 31): from the records' costs, apart from
the latency verdicts.

A record's cost is its reported tokens at the price table's prices (``llmtap.analysis.cost``); a record
without one (an unknown model, no usage, a record written before costs) is left out of the mean and
counted, so "820 of 1,000 priced" says how much of the traffic the figure speaks for. For a prompt change
that improves caching, the cost per request before and after says by how much the bill moved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from llmtap import store


@dataclass(frozen=True, slots=True)
class CostFigures:
    """The cost of some requests: how many, how many priced, their total and mean (USD)."""

    requests: int
    priced: int
    total: float
    per_request: float | None

    @classmethod
    def of(cls, groups: Iterable[store.Group]) -> CostFigures:
        """The cost of the records of ``groups``."""
        requests = priced = 0
        total = 0.0
        for g in groups:
            requests += g.requests
            priced += g.priced
            total += g.cost
        return cls.of_counts(requests, priced, total)

    @classmethod
    def of_counts(cls, requests: int, priced: int, total: float) -> CostFigures:
        """From the counts and the total."""
        return cls(requests, priced, total, total / priced if priced else None)

    def describe(self) -> str:
        """``$0.000812 (812 of 1000 priced)``, or why there is no figure."""
        if self.per_request is None:
            return f"unknown (none of {self.requests} priced)"
        return f"{usd(self.per_request)} ({self.priced} of {self.requests} priced)"


def usd(amount: float) -> str:
    """A small amount of US dollars with four significant digits: ``$0.0008123``, ``$1.234``."""
    return f"${amount:.4g}" if amount < 1 else f"${amount:,.2f}"


def change(before: CostFigures, after: CostFigures) -> dict[str, Any]:
    """Both sides' cost and the relative change of the cost per request (None unless both have one)."""
    relative = None
    if before.per_request and after.per_request is not None:
        relative = after.per_request / before.per_request - 1
    return {"before": asdict(before), "after": asdict(after), "relative": relative}


def compare_lines(cost: dict[str, Any] | None) -> list[str]:
    """The lines ``llmtap compare`` adds after its verdict."""
    if not cost:
        return []
    before, after = CostFigures(**cost["before"]), CostFigures(**cost["after"])
    moved = "" if cost["relative"] is None else f": {cost['relative']:+.1%}"
    return ["", f"cost per request: before {before.describe()}, after {after.describe()}{moved}"]


def by_route_and_shape(groups: Iterable[store.Group]) -> list[dict[str, Any]]:
    """The cost of each route and shape (``llmtap slo``), in the order of their names."""
    keyed: dict[tuple[str, str], list[store.Group]] = {}
    for g in groups:
        if g.route is not None and g.shape is not None:
            keyed.setdefault((g.route, g.shape), []).append(g)
    return [
        {"route": route, "shape": shape, **asdict(CostFigures.of(found))}
        for (route, shape), found in sorted(keyed.items())
    ]


def slo_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The lines ``llmtap slo`` adds after its table: cost per request by route and shape, when any was priced."""
    if not any(r["priced"] for r in rows):
        return []
    out = ["", "cost per request by route and shape:"]
    for r in rows:
        figures = CostFigures(r["requests"], r["priced"], r["total"], r["per_request"])
        out.append(f"  {r['route']} {r['shape']}: {figures.describe()}, {usd(figures.total)} in all")
    return out
