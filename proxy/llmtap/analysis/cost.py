"""What a request cost: a price table per model and the arithmetic over a request's reported tokens.

The table shipped in the package (``proxy/llmtap/data/prices.json``) holds the published prices of well-known
hosted models on the date it names; it is read offline, never fetched. A user's file (``--prices FILE``,
the same shape, JSON or YAML) wins model by model and can price anything else (a self-hosted model at 0).
A model neither names is priced as unknown, never as zero.

Prices are per million tokens: ``input`` (uncached input), ``cached_input`` (read from the provider's
prompt cache), ``cache_write`` (written to it), ``output`` (reasoning included); a price left out is the
``input`` price (cached and written tokens then cost what uncached ones do).

Only tokens the upstream reported are priced: a request whose usage llmtap could only estimate says
``no_usage``, since an estimate is not what the bill says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from llmtap.analysis.summary import Summary
    from llmtap.analysis.timeline import Timeline

#: ``Summary.input_source`` of a count the upstream reported (``llmtap.analysis.summary.USAGE``).
USAGE = "usage"

#: Why a request has a cost or has none.
PRICED, UNKNOWN_MODEL, NO_USAGE = "priced", "unknown_model", "no_usage"
COST_STATUSES = (PRICED, UNKNOWN_MODEL, NO_USAGE)
#: The proposed GenAI convention's ``gen_ai.usage.cost.source`` for a cost the proxy computed itself.
LOCAL = "local"

# A release suffix that names the same model at the same price: a date (2024-08-06, 20250514), -latest,
# or a three-digit revision (-001).
_RELEASE = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{8}|latest|\d{3})$")
_FIELDS = ("input", "cached_input", "cache_write", "output")
_PER = 1_000_000.0


class PriceError(ValueError):
    """A price file that cannot be read or does not fit the shape; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Price:
    """One model's prices, per million tokens."""

    input: float
    output: float
    cached_input: float
    cache_write: float
    #: Where the price came from: ``default <date>`` (the shipped table) or ``file``.
    source: str


@dataclass(frozen=True, slots=True)
class Cost:
    """A request's cost: the amount (None unless ``status`` is ``priced``) and its currency."""

    status: str
    amount: float | None = None
    currency: str = "USD"
    #: The priced model's entry and where its price came from.
    model: str | None = None
    source: str | None = None


def normalize(model: str) -> str:
    """The name a price is looked up by: lower case, no vendor prefix (``openai/``, ``models/``), no release suffix."""
    name = model.strip().lower().rsplit("/", 1)[-1]
    return _RELEASE.sub("", name)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value < 0:
        raise PriceError(f"{where}: expected a number >= 0, got {value!r}")
    if value == float("inf"):
        raise PriceError(f"{where}: expected a finite number")
    return float(value)


def parse_table(data: Any, source: str, where: str) -> dict[str, Price]:
    """The prices of a table (``{"models": {name: {"input": .., "output": ..}}}``), by lower-case model name."""
    if not isinstance(data, Mapping) or not isinstance(data.get("models"), Mapping):
        raise PriceError(f"{where}: expected a mapping with a 'models' mapping of model name to prices")
    currency = data.get("currency", "USD")
    if currency != "USD":
        raise PriceError(f"{where}: currency {currency!r}: only USD is supported")
    out: dict[str, Price] = {}
    for name, entry in data["models"].items():
        at = f"{where}: models.{name}"
        if not isinstance(name, str) or not name.strip():
            raise PriceError(f"{at}: a model name must be a non-empty string")
        if not isinstance(entry, Mapping):
            raise PriceError(f"{at}: expected a mapping of prices")
        unknown = set(entry) - set(_FIELDS)
        if unknown:
            raise PriceError(f"{at}: unknown key {sorted(unknown)[0]!r}; known: {', '.join(_FIELDS)}")
        for required in ("input", "output"):
            if required not in entry:
                raise PriceError(f"{at}: '{required}' is missing")
        values = {k: _number(entry[k], f"{at}.{k}") for k in _FIELDS if k in entry}
        out[name.strip().lower()] = Price(
            input=values["input"],
            output=values["output"],
            cached_input=values.get("cached_input", values["input"]),
            cache_write=values.get("cache_write", values["input"]),
            source=source,
        )
    return out


def load_file(path: str | Path) -> Any:
    """A price file's content (JSON, or YAML for any other suffix)."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PriceError(f"prices file {name!r}: cannot read it: {exc}") from None
    try:
        return json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:  # json.JSONDecodeError is a ValueError
        raise PriceError(f"prices file {name!r}: not valid: {exc}") from None


def default_data() -> Any:
    """The table shipped in the package."""
    return json.loads((resources.files("llmtap") / "data" / "prices.json").read_text(encoding="utf-8"))


def request_cost(table: PriceTable, tl: Timeline, s: Summary) -> Cost:
    """What a finished request cost: its reported tokens at its model's price (the response's model first)."""
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
    )


class PriceTable:
    """The shipped prices with a user's file over them; looks a model up and prices a request's tokens."""

    def __init__(self, user_file: str | None = None) -> None:
        data = default_data()
        #: The shipped table's date (its prices are as published then).
        self.date: str = str(data.get("date", "unknown"))
        self._prices = parse_table(data, f"default {self.date}", "the shipped price table")
        if user_file:
            self._prices.update(parse_table(load_file(user_file), "file", f"prices file {user_file!r}"))
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
            if len(self._memo) < 4096:  # model names come from clients: the memo stays bounded
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
    ) -> Cost:
        """The cost of reported tokens at the first of ``models`` the table prices (the response's, then the
        request's). ``input_tokens`` includes cached and written tokens; None: not reported. ``output_tokens``
        None with input reported prices output at nothing (an embeddings request has no output)."""
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
            return Cost(NO_USAGE, model=name, source=price.source)
        read = cache_read_tokens or 0
        written = cache_write_tokens or 0
        uncached = max(input_tokens - read - written, 0)
        amount = (
            uncached * price.input
            + read * price.cached_input
            + written * price.cache_write
            + (output_tokens or 0) * price.output
        ) / _PER
        return Cost(PRICED, amount=amount, model=name, source=price.source)
