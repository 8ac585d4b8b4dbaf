"""Cost per request in ``llmtap compare`` and ``llmtap slo``: from the records' costs, apart from
the latency verdicts.

A record's cost is its reported tokens at the price table's prices (``llmtap.analysis.cost``); a record
without one (an unknown model, no usage, a record written before costs) is left out of the mean and
counted, so "820 of 1,000 priced" says how much of the traffic the figure speaks for. For a prompt change
that improves caching, the cost per request before and after says by how much the bill moved.

Pure figures; the lines the commands print are ``llmtap.commands.cost``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the facts a source gives (analysis reads them; it never opens a source)
    from llmtap import store

__all__ = ["CostFigures", "by_route_and_shape", "change", "usd"]


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
