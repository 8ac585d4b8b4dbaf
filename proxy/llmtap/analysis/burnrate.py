"""Burn-rate alerting rules for the objectives, as Prometheus rule groups: no PromQL for anyone to write.

The SLI is the proxy's own verdict on each request: ``llmtap_requests_total`` by ``llmtap_slo``, ``missed`` (a
configured objective of the request's route and shape did not hold: TTFT, TPOT or end to end; errors and
cancellations miss too) over ``met`` and ``missed`` (requests with no objective, ``none``, are left out). The error
budget is what the objective allows to miss: 1 - its percentile (p99: 1%). Each proxy exports the percentile of each
route and shape's objective on ``llmtap_slo_objective_ratio`` (``routes[].slo``, else the global ``slo``: the
objectives the records carry and ``llmtap slo`` judges by), so the rules hold no objective of their own: they read
the proxy's, and stay right when the objectives change.

The alerts are the SRE workbook's multi-window, multi-burn-rate pairs ("Alerting on SLOs", table 5-8), for a 30-day
budget: a long window says the budget burns, a short one (a twelfth of it) that it still does, so an alert ends soon
after the burn does.

- page: 14.4x over 1 h and 5 min (2% of the budget in an hour), or 6x over 6 h and 30 min (5% in six hours);
- ticket: 3x over 1 d and 2 h (10% in a day), or 1x over 3 d and 6 h (10% in three days).

Pure: ``rule_groups`` returns the groups as data; ``llmtap slo --rules`` prints them, and the Helm chart's
PrometheusRule renders the same (a test holds them equal).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["ALERTS", "BUDGET", "OBJECTIVE_METRIC", "WINDOWS", "BurnAlert", "error_ratio", "rule_groups"]

#: Every window a rule reads, shortest first.
WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
#: The objective each proxy exports per route and shape (its percentile), and the budget recorded from it.
OBJECTIVE_METRIC = "llmtap_slo_objective_ratio"
BUDGET = "llmtap:slo_error_budget:ratio"
_REQUESTS = "llmtap_requests_total"
_KEYS = "llmtap_route, llmtap_request_shape"


@dataclass(frozen=True, slots=True)
class BurnAlert:
    """One alert: its name, severity role, and its (long window, short window, burn rate) pairs."""

    name: str
    severity: str  # "page" or "ticket": the severity label comes from the caller
    pairs: tuple[tuple[str, str, float], ...]
    summary: str
    description: str


ALERTS = (
    BurnAlert(
        "LlmtapErrorBudgetBurnFast",
        "page",
        (("1h", "5m", 14.4), ("6h", "30m", 6.0)),
        "llmtap route {{ $labels.llmtap_route }} ({{ $labels.llmtap_request_shape }}) burns its SLO error budget fast",
        "Requests missing their objectives (TTFT, TPOT, end to end) burn the error budget at 6x to 14.4x: at this "
        "rate a 30-day budget lasts 2 to 5 days.",
    ),
    BurnAlert(
        "LlmtapErrorBudgetBurnSlow",
        "ticket",
        (("1d", "2h", 3.0), ("3d", "6h", 1.0)),
        "llmtap route {{ $labels.llmtap_route }} ({{ $labels.llmtap_request_shape }}) burns its SLO error budget",
        "Requests missing their objectives burn the error budget at 1x to 3x over days: the 30-day budget will not "
        "last.",
    ),
)


def error_ratio(window: str) -> str:
    """The recording rule's name of the share of requests that missed their objective over ``window``."""
    return f"llmtap:slo_errors:ratio_rate{window}"


_MATCHER_NAME = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


def _by(by: str, selector: str) -> str:
    """The labels every recorded series keeps: ``by``, the selector's (so each deployment's rules read their own
    series alone), the route and the shape."""
    names = [b.strip() for b in by.split(",") if b.strip()]
    names += [n for n in _MATCHER_NAME.findall(_without_strings(selector)) if n not in names]
    return ", ".join([*names, _KEYS])


def _without_strings(selector: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', selector)


def _within(selector: str, *matchers: str) -> str:
    return ",".join(m for m in (*matchers, selector) if m)


def _burning(alert: BurnAlert, selector: str) -> str:
    """Each pair: both windows past the rate times the budget (the series of each side carry the same labels)."""
    sel = f"{{{selector}}}" if selector else ""
    budget = f"{BUDGET}{sel}"
    pairs = [
        f"({error_ratio(long)}{sel} > ({rate:g} * {budget})\n  and {error_ratio(short)}{sel} > ({rate:g} * {budget}))"
        for long, short, rate in alert.pairs
    ]
    return "\nor\n".join(pairs) + "\n"


def rule_groups(
    *, selector: str = "", by: str = "", name: str = "llmtap", page: str = "critical", ticket: str = "warning"
) -> list[dict[str, Any]]:
    """The recording and alerting groups. ``selector``: label matchers every series must have (``job="llmtap"``);
    ``by``: labels kept beside the route and shape (``namespace, job``: one alert per deployment)."""
    keys = _by(by, selector)
    missed = _within(selector, 'llmtap_slo="missed"')
    judged = _within(selector, 'llmtap_slo=~"met|missed"')
    recorded: list[dict[str, Any]] = [
        {
            "record": error_ratio(w),
            # A route and shape that never missed has no missed series: its ratio reads 0, not nothing.
            "expr": f"(\n  sum by ({keys}) (rate({_REQUESTS}{{{missed}}}[{w}]))\n  or\n"
            f"  0 * sum by ({keys}) (rate({_REQUESTS}{{{judged}}}[{w}]))\n)\n/\n"
            f"sum by ({keys}) (rate({_REQUESTS}{{{judged}}}[{w}]))\n",
        }
        for w in WINDOWS
    ]
    # Replicas export the same objective; max keeps one series per route and shape.
    recorded.append({"record": BUDGET, "expr": f"1 - max by ({keys}) ({OBJECTIVE_METRIC}{{{selector}}})\n"})
    severities = {"page": page, "ticket": ticket}
    alerts = [
        {
            "alert": a.name,
            "expr": _burning(a, selector),
            "labels": {"severity": severities[a.severity]},
            "annotations": {"summary": a.summary, "description": a.description},
        }
        for a in ALERTS
    ]
    return [{"name": f"{name}.slo.rules", "rules": recorded}, {"name": f"{name}.slo.alerts", "rules": alerts}]
