"""The cost lines ``llmtap compare`` and ``llmtap slo`` print after their verdicts (``llmtap.analysis.costreport``
computes the figures)."""

from __future__ import annotations

from typing import Any

from llmtap.analysis.costreport import CostFigures, usd

__all__ = ["compare_lines", "slo_lines"]


def compare_lines(cost: dict[str, Any] | None) -> list[str]:
    """The lines ``llmtap compare`` adds after its verdict."""
    if not cost:
        return []
    before, after = CostFigures(**cost["before"]), CostFigures(**cost["after"])
    moved = "" if cost["relative"] is None else f": {cost['relative']:+.1%}"
    return ["", f"cost per request: before {before.describe()}, after {after.describe()}{moved}"]


def slo_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The lines ``llmtap slo`` adds after its table: cost per request by route and shape, when any was priced."""
    if not any(r["priced"] for r in rows):
        return []
    out = ["", "cost per request by route and shape:"]
    for r in rows:
        figures = CostFigures(r["requests"], r["priced"], r["total"], r["per_request"])
        out.append(f"  {r['route']} {r['shape']}: {figures.describe()}, {usd(figures.total)} in all")
    return out
