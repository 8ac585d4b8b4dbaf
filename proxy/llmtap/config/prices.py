"""The price tables: the one shipped in the package and a user's file (``--prices FILE``), read and checked.

The shipped table (``proxy/llmtap/data/prices.json``) holds the published prices of well-known hosted models on
the date it names; it is read offline, never fetched. A user's file has the same shape, JSON or YAML
(``{"models": {name: {"input": .., "output": ..}}}``, prices per million tokens). The settings check a user's
file when they load (a bad one stops ``llmtap serve`` at start); ``llmtap.analysis.cost`` prices requests with
what ``load`` returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Price", "PriceError", "load", "load_file", "parse_table"]

_FIELDS = ("input", "cached_input", "cache_write", "cache_write_1h", "output")


class PriceError(ValueError):
    """A price file that cannot be read or does not fit the shape; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Price:
    """One model's prices, per million tokens."""

    input: float
    output: float
    cached_input: float
    cache_write: float
    #: Hour-long cache writes (Anthropic: twice the input price); the ``cache_write`` price when left out.
    cache_write_1h: float
    #: Where the price came from: ``default <date>`` (the shipped table) or ``file``.
    source: str


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
            cache_write_1h=values.get("cache_write_1h", values.get("cache_write", values["input"])),
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


def load(user_file: str | None = None) -> tuple[str, dict[str, Price]]:
    """The shipped table's date and the prices by lower-case model name, a user's file over the shipped ones."""
    data = default_data()
    date = str(data.get("date", "unknown"))
    prices = parse_table(data, f"default {date}", "the shipped price table")
    if user_file:
        prices.update(parse_table(load_file(user_file), "file", f"prices file {user_file!r}"))
    return date, prices
