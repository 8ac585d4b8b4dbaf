"""PromQL text and what its answers mean: string literals, selectors, counter growth between two moments.

Pure: the queries are sent by ``llmtap.commands.prometheus`` (the HTTP client of Prometheus's API).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["Grown", "growth", "keyed", "quote", "selector"]

#: A counter's growth per label set, keyed by the sorted labels.
Grown = dict[tuple[tuple[str, str], ...], float]


def quote(value: str) -> str:
    """A PromQL string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def selector(matchers: Mapping[str, str]) -> str:
    """``a="x",b="y"``: equality matchers in the order of their names."""
    return ",".join(f"{k}={quote(v)}" for k, v in sorted(matchers.items()))


def keyed(points: Iterable[tuple[dict[str, str], float]]) -> Grown:
    """An instant vector's (labels, value) pairs keyed by their sorted labels."""
    return {tuple(sorted(labels.items())): value for labels, value in points}


def growth(first: Grown | None, last: Grown) -> Grown:
    """What counters grew by between two instant vectors (``first`` None: from their beginning).

    Differences of two instant queries rather than ``increase()``: a series born inside the window
    counts from zero, and PromQL's extrapolation is left out. A counter that went down was reset (the proxy
    restarted): it counts from the reset.
    """
    if first is None:
        return last
    return {k: v - first.get(k, 0.0) if v >= first.get(k, 0.0) else v for k, v in last.items()}
