"""The routes: each from the file's ``routes:`` or the single ``--upstream``, over the top-level defaults.

A route keeps its TLS settings as given (files are read when its upstream's client is made, by
``llmtap.relay.tls``), and with them the names they were given under, so that a file that does not load is
named as the user wrote it. Also the ``shapes:`` classes and a route's objectives.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from llmtap.config import options
from llmtap.config.options import OPTIONS, ROUTE_OPTIONS, default
from llmtap.config.sources import Sources, checked, parse, unknown
from llmtap.config.types import DEFAULT_SHAPES, OTHER_SHAPE, SHAPES_MAX, SLO, ConfigError, Route, Shape

__all__ = ["check_objective_shapes", "routes", "shapes"]

_SHAPE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,31}$")


def _tls_options(
    given: Mapping[str, Any], upstream: str, defaults: Mapping[str, Any], label: Callable[[str], str]
) -> dict[str, Any]:
    """A route's ``tls_*`` settings (checked already) over the defaults for every https:// route, and the names
    they go by in messages (``tls_labels``). Their files are read where the upstream's client is made."""
    given = {k: v for k, v in given.items() if k in _TLS_KEYS and v is not None}
    if not upstream.startswith("https://"):
        if given:
            raise ConfigError(f"{label(sorted(given)[0])}: TLS settings need an https:// upstream, got {upstream}")
        return {}
    out = {**{k: v for k, v in defaults.items() if v is not None}, **given}
    if out.get("tls_key") is not None and out.get("tls_cert") is None:
        raise ConfigError(f"{label('tls_key')}: given without tls_cert")
    out["tls_labels"] = tuple((key, label(key)) for key in _TLS_KEYS)
    return out


#: A route's TLS keys and, for the single upstream, the option that gives each one for every https:// route.
_TLS_KEYS = {
    "tls_ca": "upstream_ca",
    "tls_ca_dir": "upstream_ca_dir",
    "tls_cert": "upstream_cert",
    "tls_key": "upstream_key",
    "tls_server_name": "upstream_server_name",
    "tls_verify": "tls_verify",
}
#: The settings a route takes from the top level (flags, variables, file) when it does not set them itself.
_ROUTE_DEFAULTS = [
    o.name
    for key, o in ROUTE_OPTIONS.items()
    if o.key is not None and o.name == key and key not in ("upstream", "provider", *_TLS_KEYS)
]


def _route(
    raw: Any,
    where: str,
    defaults: Mapping[str, Any],
    tls_defaults: Mapping[str, Any],
    label: Callable[[str], str],
) -> Route:
    """One route from the file (``where``: ``FILE: routes[0]``) or the single upstream, over the top-level defaults."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping with prefix and upstream")
    for key in raw:
        if key not in ROUTE_OPTIONS:
            raise unknown(f"{where}: ", key, ROUTE_OPTIONS)
    values = {
        key: parse(ROUTE_OPTIONS[key], value, f"{where}.{key}", True) for key, value in raw.items() if value is not None
    }
    if "upstream" not in values:
        raise ConfigError(f"{where}.upstream: expected a URL such as https://api.openai.com")
    prefix = values.get("prefix", "/")
    if not prefix.startswith("/"):
        raise ConfigError(f"{where}.prefix: must start with '/', got {prefix!r}")
    upstream = values["upstream"]
    queue = {key: values.get(key, defaults.get(key)) for key in _ROUTE_DEFAULTS}
    tls = _tls_options(values, upstream, tls_defaults, label)
    return Route(
        prefix=prefix.rstrip("/") or "/",
        upstream=upstream,
        name=str(values.get("name") or (prefix.strip("/") or "default")),
        provider=values.get("provider", defaults.get("provider")),
        strip_prefix=values.get("strip_prefix", False),
        slo=() if values.get("slo") is None else objectives(values["slo"], f"{where}.slo"),
        **{k: v for k, v in queue.items() if v is not None},
        **tls,
    )


_SHAPE_KEYS = ("min_input_tokens", "max_input_tokens", "min_output_tokens", "max_output_tokens")
_OBJECTIVE_KEYS = ("shape", "percentile", "ttft_ms", "tpot_ms", "e2e_ms", "ttfot_ms", "ttst_ms")


def objectives(raw: Any, what: str) -> tuple[SLO, ...]:
    """A route's ``slo``: one objective (a mapping) or a list, each ``{shape, percentile, ttft_ms, ...}``."""
    items = [raw] if isinstance(raw, Mapping) else raw
    if not isinstance(items, list):
        raise ConfigError(f"{what}: expected a list of objectives such as {{shape: long_prompt, ttft_ms: 800}}")
    out: list[SLO] = []
    for i, item in enumerate(items):
        where = f"{what}[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(
                f"{where}: expected a mapping such as {{shape: long_prompt, percentile: 95, ttft_ms: 800}}"
            )
        for key in item:
            if key not in _OBJECTIVE_KEYS:
                raise unknown(f"{where}: ", key, _OBJECTIVE_KEYS)
        limits = {
            k: checked(options.number(unit="milliseconds"), item[f"{k}_ms"], f"{where}.{k}_ms") / 1000
            for k in ("ttft", "tpot", "e2e", "ttfot", "ttst")
            if item.get(f"{k}_ms") is not None
        }
        if not limits:
            raise ConfigError(f"{where}: give at least one of ttft_ms, tpot_ms, e2e_ms, ttfot_ms, ttst_ms")
        shape = item.get("shape")
        if shape is not None:
            shape = str(shape)
            if shape != OTHER_SHAPE and not _SHAPE_NAME.match(shape):
                raise ConfigError(f"{where}.shape: {shape!r} is not a shape name")
        share = default("slo_percentile")
        if item.get("percentile") is not None:
            share = checked(options.percentile(), item["percentile"], f"{where}.percentile")
        out.append(SLO(**limits, percentile=share, shape=shape))
    return tuple(out)


def shapes(raw: Any, what: str = "shapes") -> tuple[Shape, ...]:
    """The ``shapes:`` section: class name to its token bounds, matched in the file's order."""
    if raw is None:
        return DEFAULT_SHAPES
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{what}: expected a mapping of class names to bounds, such as {{long_prompt: {{...}}}}")
    if len(raw) > SHAPES_MAX:
        raise ConfigError(f"{what}: at most {SHAPES_MAX} classes (each adds series to the latency metrics)")
    out: list[Shape] = []
    for name, bounds in raw.items():
        name = str(name)
        if name == OTHER_SHAPE or not _SHAPE_NAME.match(name):
            raise ConfigError(
                f"{what}: {name!r} is not a class name (lowercase letters, digits, _ . -, at most 32; not other)"
            )
        bounds = bounds or {}
        if not isinstance(bounds, Mapping):
            raise ConfigError(f"{what}.{name}: expected a mapping of bounds ({', '.join(_SHAPE_KEYS)})")
        for key in bounds:
            if key not in _SHAPE_KEYS:
                raise unknown(f"{what}.{name}: ", key, _SHAPE_KEYS)
        values = {k: checked(options.integer(0), v, f"{what}.{name}.{k}") for k, v in bounds.items() if v is not None}
        for kind in ("input", "output"):
            low, high = values.get(f"min_{kind}_tokens"), values.get(f"max_{kind}_tokens")
            if low is not None and high is not None and low > high:
                raise ConfigError(f"{what}.{name}: min_{kind}_tokens {low} is above max_{kind}_tokens {high}")
        out.append(Shape(name, **values))
    return tuple(out)


def _upstream_label(key: str) -> str:
    """A TLS setting as the single-upstream flag names it."""
    flag = OPTIONS[_TLS_KEYS[key]].flag or key
    return f"{flag} ({key})"


def _file_label(file: str, index: int) -> Callable[[str], str]:
    """A setting of the file's ``index``-th route as messages name it."""
    return lambda key: f"{file}: routes[{index}].{key}"


def routes(sources: Sources, values: Mapping[str, Any]) -> list[Route]:
    """Every route, longest prefix first: the file's ``routes:``, and the single upstream's at ``/`` (it replaces
    a file route at ``/``); ``values`` are the top-level options, checked already."""
    insecure = sources.given(OPTIONS["upstream_insecure"])
    tls_defaults = {key: values[name] for key, name in _TLS_KEYS.items() if sources.given(OPTIONS[name]) is not None}
    if insecure is not None:  # the flag and variable say it the other way round from the file's tls_verify
        tls_defaults["tls_verify"] = not values["upstream_insecure"]
    defaults = {name: values[name] for name in (*_ROUTE_DEFAULTS, "provider")}
    raw_routes = sources.data.get("routes") or []
    out = [
        _route(raw, f"{sources.file}: routes[{i}]", defaults, tls_defaults, _file_label(sources.file, i))
        for i, raw in enumerate(raw_routes)
    ]
    upstream = values["upstream"]
    if upstream is not None:
        out = [r for r in out if r.prefix != "/"]
        default_route = {"prefix": "/", "upstream": upstream, "name": "default"}
        out.append(_route(default_route, "upstream", defaults, tls_defaults, _upstream_label))
    given = sorted(key for key, value in tls_defaults.items() if value is not None)
    if given and out and not any(r.upstream.startswith("https://") for r in out):
        found = sources.given(OPTIONS["upstream_insecure" if given[0] == "tls_verify" else _TLS_KEYS[given[0]]])
        where = f"{found[1]} ({given[0]})" if found is not None else _upstream_label(given[0])
        raise ConfigError(f"{where}: TLS settings need an https:// upstream")
    if not out:
        raise ConfigError("no upstream: pass --upstream URL, set LLMTAP_UPSTREAM, or give routes in --config FILE")
    prefixes = [r.prefix for r in out]
    if len(set(prefixes)) != len(prefixes):
        raise ConfigError(f"{sources.file}: routes: two routes share one prefix")
    # Longest prefix first, so /openai/v1 wins over /openai.
    out.sort(key=lambda r: len(r.prefix), reverse=True)
    return out


def check_objective_shapes(routes: Iterable[Route], classes: Iterable[Shape], file: str) -> None:
    """Every route objective's shape is a class of ``shapes:`` (or ``other``)."""
    known_shapes = {c.name for c in classes} | {OTHER_SHAPE}
    for r in routes:
        for goal in r.slo:
            if goal.shape is not None and goal.shape not in known_shapes:
                raise ConfigError(
                    f"{file}: routes ({r.name}).slo: shape {goal.shape!r} is not a class of shapes: "
                    f"{', '.join(sorted(known_shapes))}"
                )
