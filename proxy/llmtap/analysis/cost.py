"""What a request cost: a price table per model and the arithmetic over a request's reported tokens.

A cost the response states comes first (``source`` ``provider``): a ``usage.cost`` field in the body or the
final chunk (OpenRouter, LiteLLM), else a cost header a gateway adds (LiteLLM's ``x-litellm-response-cost``).
Only without one is the request priced from a table (``source`` ``local``, the table named with its date).

The tables (``llmtap.config.prices``): the one shipped in the package, read offline, and a user's file
(``--prices FILE``) that wins model by model and can price anything else (a self-hosted model at 0). A model
neither names is priced as unknown, never as zero.

Prices are per million tokens: ``input`` (uncached input), ``cached_input`` (read from the provider's
prompt cache), ``cache_write`` (written to it; Anthropic's 5-minute writes, 1.25 times the input price),
``cache_write_1h`` (Anthropic's hour-long writes, twice the input price), ``output`` (reasoning included); a
price left out is the ``input`` price (``cache_write_1h``: the ``cache_write`` price).

Only tokens the upstream reported are priced: a request whose usage llmtap could only estimate says
``no_usage``, since an estimate is not what the bill says.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmtap.config import prices
from llmtap.config.prices import Price
from llmtap.providers.openai_common import reported_cost

if TYPE_CHECKING:
    from llmtap.analysis.summary import Summary
    from llmtap.analysis.timeline import Timeline

__all__ = [
    "LOCAL",
    "MEMO",
    "NO_USAGE",
    "PRICED",
    "PROVIDER",
    "UNKNOWN_MODEL",
    "Cost",
    "PriceTable",
    "header_cost",
    "normalize",
    "request_cost",
]

#: ``Summary.input_source`` of a count the upstream reported (``llmtap.analysis.summary.USAGE``).
USAGE = "usage"

#: Why a request has a cost or has none.
PRICED, UNKNOWN_MODEL, NO_USAGE = "priced", "unknown_model", "no_usage"
COST_STATUSES = (PRICED, UNKNOWN_MODEL, NO_USAGE)
#: The GenAI convention's ``gen_ai.usage.cost.source``: the response stated the cost (``provider``), or the
#: proxy computed it from its price table (``local``).
PROVIDER, LOCAL = "provider", "local"
#: Response headers in which a gateway states a request's cost (USD), in the order they are read.
COST_HEADERS = ("x-litellm-response-cost",)
#: Model names whose price entry is remembered at most (names come from clients).
MEMO = 4096

# A release suffix that names the same model at the same price: a date (2024-08-06, 20250514), -latest,
# or a three-digit revision (-001).
_RELEASE = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{8}|latest|\d{3})$")
_PER = 1_000_000.0


@dataclass(frozen=True, slots=True)
class Cost:
    """A request's cost: the amount (None unless ``status`` is ``priced``), its currency and where it came from."""

    status: str
    amount: float | None = None
    currency: str = "USD"
    #: The priced model's entry and the table its price came from (``default <date>`` or ``file``).
    model: str | None = None
    prices: str | None = None
    #: ``provider`` (the response stated it) or ``local`` (the table's prices); None without an amount.
    source: str | None = None


def header_cost(headers: Mapping[str, str]) -> float | None:
    """The cost a gateway states in a response header (lower-case names), USD; None without a readable one."""
    for name in COST_HEADERS:
        value = headers.get(name)
        if value is not None:
            return reported_cost(value)
    return None


def stated_cost(tl: Timeline) -> Cost | None:
    """The cost the response stated (the body's ``usage.cost`` first, then a gateway's header), or None."""
    amount = tl.usage.cost if tl.usage is not None else None
    if amount is None:
        amount = tl.header_cost
    return None if amount is None else Cost(PRICED, amount=amount, source=PROVIDER)


def normalize(model: str) -> str:
    """The name a price is looked up by: lower case, no vendor prefix (``openai/``, ``models/``), no release suffix."""
    name = model.strip().lower().rsplit("/", 1)[-1]
    return _RELEASE.sub("", name)


def request_cost(table: PriceTable, tl: Timeline, s: Summary) -> Cost:
    """What a finished request cost: the cost the response stated, else its reported tokens at its model's price
    (the response's model first)."""
    stated = stated_cost(tl)
    if stated is not None:
        return stated
    req = tl.request
    reported = s.input_source == USAGE
    output = s.output_tokens if s.output_source == USAGE else None
    if output is None and s.output_tokens:
        # Output was generated but only estimated: the bill's number is not known.
        reported = False
    return table.cost(
        (tl.response_model, req.model if req is not None else None),
        input_tokens=s.input_tokens if reported else None,
        output_tokens=output,
        cache_read_tokens=s.cache_read_tokens if reported else None,
        cache_write_tokens=s.cache_write_tokens if reported else None,
        cache_write_1h_tokens=tl.usage.cache_write_1h_tokens if reported and tl.usage is not None else None,
    )


class PriceTable:
    """The shipped prices with a user's file over them; looks a model up and prices a request's tokens."""

    def __init__(self, user_file: str | None = None) -> None:
        #: The shipped table's date (its prices are as published then).
        self.date, self._prices = prices.load(user_file)
        self._normalized: dict[str, str] = {}
        for name in self._prices:
            self._normalized.setdefault(normalize(name), name)
        self._memo: dict[str, str | None] = {}

    def lookup(self, model: str) -> tuple[str, Price] | None:
        """The entry that prices ``model``: its exact name (case aside), else its normalized name."""
        found = self._memo.get(model, "")
        if found == "":
            lowered = model.strip().lower()
            found = lowered if lowered in self._prices else self._normalized.get(normalize(model))
            if len(self._memo) < MEMO:  # model names come from clients: the memo stays bounded
                self._memo[model] = found
        return None if found is None else (found, self._prices[found])

    def cost(
        self,
        models: tuple[str | None, ...],
        *,
        input_tokens: int | None,
        output_tokens: int | None,
        cache_read_tokens: int | None = None,
        cache_write_tokens: int | None = None,
        cache_write_1h_tokens: int | None = None,
    ) -> Cost:
        """The cost of reported tokens at the first of ``models`` the table prices (the response's, then the
        request's). ``input_tokens`` includes cached and written tokens, ``cache_write_tokens`` the hour-long
        writes ``cache_write_1h_tokens``; None: not reported. ``output_tokens`` None with input reported prices
        output at nothing (an embeddings request has no output)."""
        entry = None
        for model in models:
            if model:
                entry = self.lookup(model)
                if entry is not None:
                    break
        if entry is None:
            return Cost(UNKNOWN_MODEL)
        name, price = entry
        if input_tokens is None:
            return Cost(NO_USAGE, model=name, prices=price.source)
        read = cache_read_tokens or 0
        written = cache_write_tokens or 0
        hour = min(cache_write_1h_tokens or 0, written)
        uncached = max(input_tokens - read - written, 0)
        amount = (
            uncached * price.input
            + read * price.cached_input
            + (written - hour) * price.cache_write
            + hour * price.cache_write_1h
            + (output_tokens or 0) * price.output
        ) / _PER
        return Cost(PRICED, amount=amount, model=name, prices=price.source, source=LOCAL)
