"""How option values are read, checked and described: a ``Kind`` per sort of value (``integer(0, 65535)``,
``choice("idle", "nice", "normal")``, ``url()``...), used by the option table (``llmtap.config.options``).

A value that does not fit raises ``Invalid`` with what was expected (``expected an integer from 0 to
65535``); ``llmtap.config.sources`` adds where the value came from.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llmtap.labels import INVALID_VERSION, LABEL_CAP, VERSION_MAX_BYTES, clean, version_label

__all__ = [
    "CONTENT_FIELDS",
    "CONTENT_RULES",
    "METRIC_MODELS_MAX",
    "Invalid",
    "Kind",
    "address",
    "binary",
    "boolean",
    "buffer_size",
    "byte_size",
    "check_url",
    "choice",
    "content_rules",
    "dimension_names",
    "host_name",
    "integer",
    "model_names",
    "number",
    "path",
    "percentile",
    "share",
    "structure",
    "text",
    "url",
    "version",
]


class Invalid(ValueError):
    """A value that does not fit its option; the message says what was expected (``expected ...``)."""


@dataclass(frozen=True, slots=True)
class Kind:
    """How an option's value is read from text or YAML, checked, shown, and described in the schema."""

    #: What a valid value is, to finish "expected ...": ``an integer from 0 to 65535``.
    expected: str
    parse: Callable[[Any], Any]
    #: The JSON Schema of the value as the YAML file gives it.
    schema: Mapping[str, Any]
    metavar: str = "VALUE"
    show: Callable[[Any], str] = str


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _scalar(value: Any) -> Any:
    if isinstance(value, Mapping | list | tuple | set):
        raise Invalid("expected a single value, not a list or mapping")
    return value.strip() if isinstance(value, str) else value


def boolean() -> Kind:
    """true or false (also 1/0, yes/no, on/off)."""

    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        text = str(_scalar(value)).lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise Invalid("expected true or false")

    return Kind("true or false", parse, {"type": "boolean"}, "BOOL", lambda v: "true" if v else "false")


def _whole(value: Any) -> int:
    value = _scalar(value)
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(value)
        return int(value)
    return int(value)


def integer(
    minimum: int = 0, maximum: int | None = None, *, metavar: str = "N", show: Callable[[Any], str] = str
) -> Kind:
    """A whole number in ``[minimum, maximum]``."""
    expected = f"an integer from {minimum} to {maximum}" if maximum is not None else f"an integer >= {minimum}"

    def parse(value: Any) -> int:
        try:
            number = _whole(value)
        except (TypeError, ValueError, OverflowError):
            raise Invalid(f"expected {expected}") from None
        if number < minimum or (maximum is not None and number > maximum):
            raise Invalid(f"expected {expected}")
        return number

    schema: dict[str, Any] = {"type": "integer", "minimum": minimum}
    if maximum is not None:
        schema["maximum"] = maximum
    return Kind(expected, parse, schema, metavar, show)


def number(minimum: float = 0.0, *, above: bool = False, unit: str = "", metavar: str = "X") -> Kind:
    """A finite number ``>= minimum`` (``> minimum`` when ``above``)."""
    what = f"a number of {unit}" if unit else "a number"
    expected = f"{what} {'>' if above else '>='} {minimum:g}"

    def parse(value: Any) -> float:
        value = _scalar(value)
        try:
            if isinstance(value, bool):
                raise ValueError(value)
            result = float(value)
        except (TypeError, ValueError, OverflowError):
            raise Invalid(f"expected {expected}") from None
        if not math.isfinite(result) or result < minimum or (above and result == minimum):
            raise Invalid(f"expected {expected}")
        return result

    bound = "exclusiveMinimum" if above else "minimum"
    return Kind(expected, parse, {"type": "number", bound: minimum}, metavar, lambda v: f"{v:g}")


def choice(*values: str | int, aliases: Mapping[Any, str] | None = None) -> Kind:
    """One of ``values`` (text compared without case); ``aliases`` maps what YAML reads instead (``off``: False)."""
    expected = "one of " + ", ".join(str(v) for v in values)
    by_text = {str(v).lower(): v for v in values}

    def parse(value: Any) -> str | int:
        if aliases is not None and not isinstance(value, str) and value in aliases:
            return aliases[value]
        found = by_text.get(str(_scalar(value)).lower())
        if found is None:
            raise Invalid(f"expected {expected}")
        return found

    schema: dict[str, Any] = {"enum": [*values, *(aliases or {})]}
    return Kind(expected, parse, schema, "{" + ",".join(str(v) for v in values) + "}")


def text(metavar: str = "TEXT") -> Kind:
    """A non-empty string."""

    def parse(value: Any) -> str:
        result = str(_scalar(value))
        if not result:
            raise Invalid("expected a non-empty text")
        return result

    return Kind("a non-empty text", parse, {"type": "string", "minLength": 1}, metavar)


def path(metavar: str = "FILE") -> Kind:
    """A file or directory name (``~`` expanded)."""

    def parse(value: Any) -> str:
        name = str(_scalar(value))
        if not name:
            raise Invalid("expected a file name")
        return str(Path(name).expanduser())

    return Kind("a file name", parse, {"type": "string", "minLength": 1}, metavar)


def check_url(url: Any) -> str:
    """A normalized upstream base URL (http or https, a host, no query), else ``Invalid``."""
    if not isinstance(url, str) or not url:
        raise Invalid("expected a URL such as https://api.openai.com")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError as exc:
        raise Invalid(f"expected a URL such as https://api.openai.com ({str(exc).lower()})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Invalid("expected an http:// or https:// URL with a host, such as https://api.openai.com")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise Invalid("expected a base URL without query, fragment or credentials")
    return url.rstrip("/")


def url() -> Kind:
    """An upstream's base URL."""
    return Kind("an http:// or https:// URL", check_url, {"type": "string", "pattern": "^https?://"}, "URL")


def host_name() -> Kind:
    """A host name as TLS sends it (SNI): no spaces, ports or paths."""

    def parse(value: Any) -> str:
        name = str(_scalar(value))
        if not name or any(c.isspace() or c in "/:@" for c in name):
            raise Invalid("expected a host name")
        return name

    return Kind("a host name", parse, {"type": "string", "pattern": r"^[^\s/:@]+$"}, "NAME")


def address() -> Kind:
    """``host:port`` in the characters a W3C ``tracestate`` value allows (``llmtap.wire.tracestate.ADDRESS``)."""
    pattern = r"[A-Za-z0-9.\-\[\]:]{1,200}:[0-9]{1,5}"

    def parse(value: Any) -> str:
        found = str(_scalar(value)).strip()
        if re.fullmatch(pattern, found) is None or not 0 < int(found.rpartition(":")[2]) < 65536:
            raise Invalid("expected host:port (a name or address, then a port from 1 to 65535)")
        return found

    return Kind("host:port", parse, {"type": "string", "pattern": f"^{pattern}$"}, "HOST:PORT")


def version() -> Kind:
    """A prompt version label."""
    expected = f"a label of 1 to {VERSION_MAX_BYTES} bytes without control characters"

    def parse(value: Any) -> str:
        label = version_label(str(_scalar(value)))
        if label is None or label == INVALID_VERSION:
            raise Invalid(f"expected {expected}")
        return label

    return Kind(expected, parse, {"type": "string", "pattern": r"^[^\x00-\x1f\x7f]+$"}, "LABEL")


#: Names ``metric_models`` may list: each one adds its series to every instrument.
METRIC_MODELS_MAX = 256


def model_names() -> Kind:
    """Model names: a list in the file, comma-separated in a flag or variable."""

    def parse(value: Any) -> tuple[str, ...]:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise Invalid("expected a list of model names")
        names = tuple(dict.fromkeys(str(item).strip() for item in items if str(item).strip()))
        for name in names:
            if clean(name, LABEL_CAP, label=True) != name:
                raise Invalid(f"{name[:40]!r}: a name of at most {LABEL_CAP} characters, no control characters")
        if len(names) > METRIC_MODELS_MAX:
            raise Invalid(f"at most {METRIC_MODELS_MAX} names, got {len(names)}")
        return names

    schema = {"type": "array", "items": {"type": "string"}, "maxItems": METRIC_MODELS_MAX}
    return Kind("a list of model names", parse, schema, "A,B", lambda v: ",".join(v) or "none")


def binary(size: Any) -> str:
    """A byte count as people read it: ``8 MiB``, ``64 KiB``, ``1000``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return str(size)


def byte_size(minimum: int = 1024) -> Kind:
    """A byte limit: a whole number of at least ``minimum`` (1 KiB: less could not hold a request line)."""
    return integer(minimum, metavar="BYTES", show=binary)


def buffer_size() -> Kind:
    """A socket buffer: 0 (the kernel's own) or at least 4 KiB."""
    expected = "0 (the kernel's) or an integer >= 4096"
    base = integer(0)

    def parse(value: Any) -> int:
        try:
            size: int = base.parse(value)
        except Invalid:
            raise Invalid(f"expected {expected}") from None
        if 0 < size < 4096:
            raise Invalid(f"expected {expected}")
        return size

    return Kind(expected, parse, {"type": "integer", "minimum": 0}, "BYTES", binary)


def percentile() -> Kind:
    """A percentile as ``95``, ``99.9``, ``p95`` or ``0.95``; the value is the share (``0.95``)."""
    expected = "a percentile such as 95, p99 or 0.999"

    def parse(value: Any) -> float:
        value = _scalar(value)
        text = str(value).lower().removeprefix("p")
        try:
            if isinstance(value, bool):
                raise ValueError(value)
            number = float(text)
        except (TypeError, ValueError, OverflowError):
            raise Invalid(f"expected {expected}") from None
        share = number / 100 if number > 1 else number
        if not math.isfinite(share) or not 0 < share < 1:
            raise Invalid(f"expected {expected}")
        return share

    schema = {"type": ["number", "string"], "pattern": "^p?[0-9.]+$"}
    return Kind(expected, parse, schema, "PERCENTILE", lambda v: f"p{v * 100:g}")


def share() -> Kind:
    """A share from 0 to 1 inclusive, as ``0.05`` or ``5%``."""
    expected = "a share from 0 to 1, such as 0.05 or 5%"

    def parse(value: Any) -> float:
        value = _scalar(value)
        text = str(value).strip()
        try:
            if isinstance(value, bool):
                raise ValueError(value)
            number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except (TypeError, ValueError, OverflowError):
            raise Invalid(f"expected {expected}") from None
        if not math.isfinite(number) or not 0 <= number <= 1:
            raise Invalid(f"expected {expected}")
        return number

    schema = {"type": ["number", "string"], "pattern": "^[0-9.]+%?$"}
    return Kind(expected, parse, schema, "SHARE", lambda v: f"{v:g}")


def structure(expected: str, types: tuple[type, ...], schema: Mapping[str, Any]) -> Kind:
    """A YAML-only value (a mapping or a list) taken as it is, for ``llmtap.config.routes`` to check in depth."""

    def parse(value: Any) -> Any:
        if not isinstance(value, types):
            raise Invalid(f"expected {expected}")
        return value

    return Kind(expected, parse, schema, "YAML", lambda v: "see the file")


# -- attribution ------------------------------------------------------------------------

#: Request dimensions a client names (``proxy.attribution``): the operator lists the ones metrics may carry.
DIMENSIONS = ("tenant", "user", "api_key")
#: A custom property by its header's name: ``property.<name>`` for ``x-llmtap-property-<name>``.
PROPERTY_DIMENSION = re.compile(r"property\.[a-z0-9_]{1,64}")
METRIC_DIMENSIONS_MAX = 8


def dimension_names() -> Kind:
    """Attribution dimensions: tenant, user, api_key, property.<name>; a list in the file, comma-separated
    in a flag or variable."""
    expected = "a list of tenant, user, api_key or property.<name> (lower case letters, digits, _)"

    def parse(value: Any) -> tuple[str, ...]:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise Invalid(f"expected {expected}")
        names = tuple(dict.fromkeys(str(item).strip().lower() for item in items if str(item).strip()))
        for name in names:
            if name not in DIMENSIONS and not PROPERTY_DIMENSION.fullmatch(name):
                raise Invalid(f"{name[:40]!r}: expected {expected}")
        if len(names) > METRIC_DIMENSIONS_MAX:
            raise Invalid(f"at most {METRIC_DIMENSIONS_MAX} dimensions, got {len(names)}")
        return names

    schema = {"type": "array", "items": {"type": "string"}, "maxItems": METRIC_DIMENSIONS_MAX}
    return Kind(expected, parse, schema, "D,E", lambda v: ",".join(v) or "none")


#: The content event's fields (``gen_ai.system_instructions``, ``gen_ai.input.messages``, ``gen_ai.output.messages``)
#: and what may become of each: carried as it is, replaced by its SHA-256, or left out.
CONTENT_FIELDS = ("system", "input", "output")
CONTENT_RULES = ("keep", "hash", "drop")


def content_rules() -> Kind:
    """The content event's rule per field: ``input=keep,output=hash`` in a flag or variable, a mapping in the file.

    Nothing named: no event. A field not named is dropped, so each field that leaves is one the operator named."""
    expected = (
        f"FIELD=RULE pairs, comma-separated, FIELD one of {', '.join(CONTENT_FIELDS)}, RULE {', '.join(CONTENT_RULES)}"
    )

    def parse(value: Any) -> tuple[tuple[str, str], ...]:
        if isinstance(value, Mapping):
            pairs = [(str(k), str(v)) for k, v in value.items()]
        elif isinstance(value, str):
            pairs = [tuple(p.split("=", 1)) if "=" in p else (p, "") for p in value.split(",") if p.strip()]  # type: ignore[misc]
        else:
            raise Invalid(f"expected {expected}")
        rules: dict[str, str] = {}
        for name, rule in pairs:
            name, rule = name.strip().lower(), rule.strip().lower()
            if name not in CONTENT_FIELDS or rule not in CONTENT_RULES:
                raise Invalid(f"{name[:40]}={rule[:40]}: expected {expected}")
            rules[name] = rule
        return tuple((f, rules[f]) for f in CONTENT_FIELDS if f in rules)

    schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {f: {"enum": list(CONTENT_RULES)} for f in CONTENT_FIELDS},
    }
    return Kind(expected, parse, schema, "FIELD=RULE,..", lambda v: ",".join(f"{f}={r}" for f, r in v) or "off")
