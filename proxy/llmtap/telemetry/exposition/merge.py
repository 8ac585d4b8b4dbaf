"""Several telemetry processes' ``/metrics`` pages merged into one (``--telemetry-workers``): each family once,
counters and histogram buckets summed by series, a histogram's sparse buckets filled in where one page lacks a
bound another has (``llmtap.telemetry.exposition.prometheus`` writes them sparse), exemplars kept (the latest)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["merge_metrics"]


def _value(text: str) -> float:
    return float(text.replace("+Inf", "inf").replace("-Inf", "-inf"))


def _render(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


#: A sample line: series (name, labels with quoted values), value, an optional timestamp, an optional exemplar.
_SAMPLE = re.compile(r'([^{\s]+(?:\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?) (\S+)(?: [^#\s]\S*)?( # \{.*)?')


def _sample(line: str) -> tuple[str, float, str]:
    """A sample line's series (name and labels), value, and exemplar (`` # {...} value timestamp``, or "")."""
    if " # " not in line:  # the common case, and the fast one: the value is the last field
        key, _, value = line.rpartition(" ")
        return key, _value(value), ""
    match = _SAMPLE.fullmatch(line)
    if match is None:
        raise ValueError(f"not a sample line: {line[:200]!r}")
    return match[1], _value(match[2]), match[3] or ""


def _exemplar_time(exemplar: str) -> float:
    """An exemplar's timestamp (its last field after the labels), or -inf when it has none."""
    fields = exemplar.rsplit("}", 1)[-1].split()
    return float(fields[1]) if len(fields) > 1 else -math.inf


def _bucket_key(key: str) -> tuple[str, float] | None:
    """A ``_bucket`` sample's series (its key less the ``le`` label) and bound, or None for other samples."""
    head, sep, tail = key.rpartition('le="')
    if not sep or not head.split("{", 1)[0].endswith("_bucket"):
        return None
    return head, _value(tail.partition('"')[0])


def _fill_buckets(samples: dict[str, float], les: dict[str, dict[float, str]]) -> None:
    """Give a page's sparse histogram series every bound its family has on any page (``les``: family ->
    bound -> the key suffix that writes it). A bound a page left out had no value at or below it that
    the bound below it did not count: its cumulative count is that of the nearest bound written below."""
    series: dict[str, list[tuple[float, float]]] = {}
    for key, value in samples.items():
        parsed = _bucket_key(key)
        if parsed is not None:
            series.setdefault(parsed[0], []).append((parsed[1], value))
    for head, points in series.items():
        known = les.get(head.split("{", 1)[0], {})
        present = sorted(points)
        have = {le for le, _ in present}
        k, below = 0, 0.0
        for le in sorted(known):
            while k < len(present) and present[k][0] <= le:
                below = present[k][1]
                k += 1
            if le not in have:
                samples[head + known[le]] = below


def merge_metrics(texts: Sequence[str], *, openmetrics: bool = False) -> str:
    """One Prometheus exposition from several: the same series (name and labels) summed, families kept whole.

    Samples belong to the family of the ``# TYPE`` line above them; a series only some workers have is
    added at the end of its family, so a histogram's buckets, sum and count stay together. OpenMetrics pages
    (``openmetrics``) merge the same way, each sample keeping the newest exemplar any page gave it, and end
    with ``# EOF``. Sparse histograms (``render``) are filled out to the bounds any page writes first, so
    the sums add bucket by bucket.
    """
    families: dict[str, tuple[list[str], dict[str, float], dict[str, str]]] = {}
    pages: list[list[tuple[str, str, float, str]]] = []
    les: dict[str, dict[float, str]] = {}
    for text in texts:
        page: list[tuple[str, str, float, str]] = []
        current: str | None = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith(("# HELP ", "# TYPE ", "# UNIT ")):
                current = line.split(" ", 3)[2]
                meta = families.setdefault(current, ([], {}, {}))[0]
                if not any(m.startswith(line[:7]) for m in meta):
                    meta.append(line)
                continue
            if line.startswith("#"):
                continue
            key, value, exemplar = _sample(line)
            if current is None:
                current = key.split("{", 1)[0]
                families.setdefault(current, ([], {}, {}))
            parsed = _bucket_key(key)
            if parsed is not None:
                les.setdefault(parsed[0].split("{", 1)[0], {})[parsed[1]] = key[len(parsed[0]) :]
            page.append((current, key, value, exemplar))
        pages.append(page)
    for page in pages:
        values = {key: value for _, key, value, _ in page}
        if les:
            _fill_buckets(values, les)
        family_of = {key: fam for fam, key, _, _ in page}
        for key, value in values.items():
            fam = family_of.get(key)
            if fam is None:  # a filled bound: its family is the histogram's, named by the series
                fam = _family(key, families)
            _, samples, _ = families[fam]
            samples[key] = samples.get(key, 0.0) + value
        for fam, key, _, exemplar in page:
            exemplars = families[fam][2]
            if exemplar and (key not in exemplars or _exemplar_time(exemplars[key]) <= _exemplar_time(exemplar)):
                exemplars[key] = exemplar
    order = {"# HELP": 0, "# TYPE": 1, "# UNIT": 2}
    out: list[str] = []
    for meta, samples, exemplars in families.values():
        out += sorted(meta, key=lambda m: order.get(m[:6], 3))
        out += [f"{key} {_render(value)}{exemplars.get(key, '')}" for key, value in _in_order(samples)]
    if openmetrics:
        return "\n".join([*out, "# EOF"]) + "\n"
    return "\n".join(out) + "\n" if out else "# no metrics\n"


def _family(key: str, families: Mapping[str, Any]) -> str:
    """The family of a ``<family>_bucket{...}`` key."""
    name = key.split("{", 1)[0].removesuffix("_bucket")
    return name if name in families else next(f for f in families if name.startswith(f))


def _in_order(samples: dict[str, float]) -> list[tuple[str, float]]:
    """A family's samples in first-seen order, each series' buckets by bound (filled ones were added last)."""
    rank: dict[str, int] = {}
    out: list[tuple[int, float, int, str, float]] = []
    for n, (key, value) in enumerate(samples.items()):
        parsed = _bucket_key(key)
        head = parsed[0] if parsed is not None else key
        group = rank.setdefault(head, len(rank))
        out.append((group, parsed[1] if parsed is not None else 0.0, n, key, value))
    out.sort()
    return [(key, value) for _, _, _, key, value in out]
