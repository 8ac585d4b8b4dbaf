"""Where records are read back at scale: one small interface, several sources.

``llmtap compare`` and ``llmtap slo`` never read a record themselves. They ask a ``Source`` for the
facts of the records that pass a ``Filter``, grouped by side (a prompt version, or before/after a
moment), route and shape: counts, token sums, the newest objective, and each figure's values
SORTED, as ``array('d')``. llmtap's statistics (``llmtap.analysis.stats``) then draw their exact
bootstrap from the sorted values, so every source gives the same figures, intervals and verdicts.

The facts are defined over the flat columns of a record (``COLUMNS``): ``time_s``, ``route``,
``model``, ``shape``, ``prompt_version``, ``outcome``, ``stream``, ``slo``, ``ttft``, ``tpot``,
``e2e``, ``ttfot``, ``ttst``, ``prefill``, ``prefill_source``, ``input_tokens``, ``cache_read_tokens``,
``cache_class``, ``obj_shape``, ``obj_percentile``, ``obj_ttft``, ``obj_tpot``, ``obj_e2e``, ``obj_ttfot``,
``obj_ttst``, ``trace_id``, ``span_id``, ``record_id``, ``instance_id``, ``cost``, ``ro_ttft``, ``ro_tpot``. A record
without a readable time belongs to no window and is left out (counted).

Every source skips, names and counts what it cannot read (a damaged file, a line that is not a record: the
causes are ``llmtap.store.skips.CAUSES``) and answers from the rest; and each source counts a record once by
its identity, its ``record_id``, or in a record of an older version that has none its ``trace_id`` and ``span_id``
(a journal replays records at least once: the first copy read counts, a record without an identity counts as it
is; ``llmtap.store.files.identity``).

Sources:

* ``llmtap.store.engine.EngineSource``: record files (any number of paths, globs, directories;
  ``.jsonl``, ``.jsonl.gz``, ``.parquet``, the rotated ``PATH.N``) read by the embedded engine,
  DuckDB, which filters, groups and sorts; the default when it is installed (``pip install
  'llmtap[analysis]'``: DuckDB and numpy, some 130 MB that a proxy's image leaves out).
* ``llmtap.store.python.PythonSource``: the same files read in one pass in plain Python (no engine);
  the reference the engine is tested against, enough for small inputs, and the default without DuckDB.

A new source (ClickHouse, say) plugs in by implementing ``Source``: a class with ``scan`` (and
``count_met`` for ``--config``) that computes the same ``Group`` facts from its own store, typically one
``GROUP BY side, route, shape`` query producing the flat columns' aggregates, plus one ordered query per
figure for the sorted values; then ``llmtap.store.open_source`` (or the command) picks it. The
definitions each aggregate must follow are on ``Group``'s fields; ``tests/store/test_store.py`` holds a
source to the reference.
"""

from __future__ import annotations

import importlib.util
from array import array
from dataclasses import dataclass, field
from typing import Protocol

from llmtap.store.skips import CAUSES, Skips

__all__ = [
    "ANALYSIS_EXTRA",
    "COLUMNS",
    "ENGINES",
    "REQUEST_OBJECTIVES",
    "REQUEST_OUTCOMES",
    "SLOWEST",
    "TIME_GRAMMAR",
    "VERSION",
    "By",
    "Filter",
    "Group",
    "Objective",
    "Scan",
    "Skips",
    "Source",
    "count_request_objective",
    "default_engine",
    "engine_installed",
    "open_source",
    "slowest",
]

#: The flat columns of a record, as every source names them, with their types.
COLUMNS: dict[str, str] = {
    "time_s": "float",  # epoch seconds of the record's ``time``
    "route": "str",
    "model": "str",
    "shape": "str",
    "prompt_version": "str",
    "outcome": "str",
    "stream": "bool",  # True only for a JSON true
    "slo": "str",  # 'met' / 'missed' / null
    "ttft": "float",
    "tpot": "float",
    "e2e": "float",
    "ttfot": "float",  # time to the first output token (after any reasoning); TTFT without reasoning
    "ttst": "float",  # time to the second token; null for a stream of one content chunk (absent, never 0)
    "prefill": "float",
    "prefill_source": "str",
    "input_tokens": "int",  # tokens.input
    "cache_read_tokens": "int",  # tokens.cache_read
    "cache_class": "str",  # cache.class
    "obj_shape": "str",  # objective.shape
    "obj_percentile": "float",  # objective.percentile
    "obj_ttft": "float",  # objective.ttft
    "obj_tpot": "float",
    "obj_e2e": "float",
    "obj_ttfot": "float",
    "obj_ttst": "float",
    "trace_id": "str",
    "span_id": "str",  # with trace_id, what identifies a record without a record_id (counted once)
    "record_id": "str",  # what identifies a record, traced or not (counted once)
    "instance_id": "str",
    "cost": "float",  # cost.amount: null when unpriced
    "ro_ttft": "str",  # request_objective.ttft_outcome: 'met' / 'violated' / null (the request's own x-slo-ttft-ms)
    "ro_tpot": "str",  # request_objective.tpot_outcome
}
#: A value of the wrong type (a string where a number belongs, a boolean for a number) reads as null.

#: The figures of an objective.
FIGURES = ("ttft", "tpot", "e2e", "ttfot", "ttst")
#: The figures a request's own objective bounds (``x-slo-*`` headers), each the column of its outcome, and the
#: outcomes a group counts (any other value is counted as neither).
REQUEST_OBJECTIVES = {"ttft": "ro_ttft", "tpot": "ro_tpot"}
REQUEST_OUTCOMES = ("met", "violated")
#: The slowest requests a group names by trace id (``Group.slowest``): what "which requests are the p99" reads.
SLOWEST = 5
#: What a record's ``time`` may be, for every engine alike (each parser on its own accepts forms the other refuses:
#: ISO week dates, basic format and a decimal comma in Python, ``24:00`` and a zone name in DuckDB): an ISO 8601
#: extended date, optionally a time (``T`` or a space, minutes, seconds, any fraction) and a zone (``Z``, ``+HH``,
#: ``+HHMM``, ``+HH:MM``); without a zone, UTC. Around it only space, tab, CR and LF are ignored. A regular expression
#: both Python's ``re`` and DuckDB's RE2 read the same way.
TIME_GRAMMAR = (
    "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-[0-9]{2}-[0-9]{2}"
    "(?:[T ](?:[01][0-9]|2[0-3]):[0-5][0-9](?::[0-5][0-9](?:[.][0-9]+)?)?"
    "(?:Z|[+-](?:[01][0-9]|2[0-3])(?::?[0-5][0-9])?)?)?"
)


@dataclass(frozen=True, slots=True)
class Filter:
    """Which records count: equal route / model / shape when given, time within [start, end] when given
    ([start, end) with ``open_end``)."""

    route: str | None = None
    model: str | None = None
    shape: str | None = None
    start: float | None = None
    end: float | None = None
    open_end: bool = False


@dataclass(frozen=True, slots=True)
class Objective:
    """The objective a record carries (its ``objective`` object), flattened."""

    shape: str | None
    percentile: float
    ttft: float | None
    tpot: float | None
    e2e: float | None
    ttfot: float | None = None
    ttst: float | None = None

    def order(self) -> tuple[float, float, float, float, float, float, str]:
        """How two objectives of records at the same moment are ranked (the greater wins)."""
        limits = (-1.0 if v is None else v for v in (self.ttft, self.tpot, self.e2e, self.ttfot, self.ttst))
        return (self.percentile, *limits, self.shape or "")  # type: ignore[return-value]


@dataclass(slots=True)
class Group:
    """The facts of the records that share a side key, a route and a shape (route/shape may be null)."""

    key: str | None  # the prompt version, or 'before'/'after' a split moment
    route: str | None
    shape: str | None
    requests: int = 0
    errors: int = 0  # outcome != 'ok'
    met: int = 0  # slo == 'met'
    first: float = 0.0  # least time_s
    last: float = 0.0  # greatest time_s
    #: Sums over ok records whose input_tokens is not null (cache_read null counts as 0).
    input_tokens: int = 0
    cached_tokens: int = 0
    #: The objective of the newest record whose objective is valid (0 < obj_percentile < 1 and at least one
    #: limit): greatest time_s, ties broken by the greatest (percentile, ttft, tpot, e2e, ttfot, ttst, shape), a null
    #: limit as -1 and a null shape as ''; and that record's time_s.
    objective: Objective | None = None
    objective_time: float = 0.0
    classes: dict[str, int] = field(default_factory=dict)  # cache_class counts (null left out)
    #: Records with a cost (not null, whatever their outcome), and the sum of it.
    priced: int = 0
    cost: float = 0.0
    #: Records judged by their own objectives, by figure and outcome (``REQUEST_OBJECTIVES``, ``REQUEST_OUTCOMES``;
    #: a count of 0 left out): ``{"ttft": {"met": 12, "violated": 3}}``.
    request_objectives: dict[str, dict[str, int]] = field(default_factory=dict)
    #: prefill_source (null as 'unknown') of ok streams with a TTFT and a prefill.
    prefill_sources: set[str] = field(default_factory=set)
    # Sorted values:
    ttft_ok: array[float] = field(default_factory=lambda: array("d"))  # ok streams' ttft
    ttft_failed: array[float] = field(default_factory=lambda: array("d"))  # not-ok streams' ttft
    prefill: array[float] = field(default_factory=lambda: array("d"))  # prefill of ok streams with a ttft
    tpot: array[float] = field(default_factory=lambda: array("d"))  # ok records' tpot
    e2e: array[float] = field(default_factory=lambda: array("d"))  # every record's e2e
    #: ok streams' (stream true) ttfot and ttst where the record has one, whatever its ttft (a stream of one
    #: content chunk has no ttst: absent, not 0; a stream without reasoning has its ttft as ttfot).
    ttfot: array[float] = field(default_factory=lambda: array("d"))
    ttst: array[float] = field(default_factory=lambda: array("d"))
    #: The ``SLOWEST`` ok streams of greatest ttft (those of ``ttft_ok``), as (ttft, trace_id): the slowest
    #: first, ties by trace id (a null trace id as ''), so every source names the same requests.
    slowest: list[tuple[float, str]] = field(default_factory=list)


@dataclass(slots=True)
class Scan:
    """What a scan found: the groups, and what was read to find them."""

    groups: list[Group]
    source: str  # how the report names what was read
    records: int = 0  # records read (before the filter), each identity once, those without a time left out
    files: int = 0
    #: What was passed over (lines, records, files) by cause, and where (``llmtap.store.skips``).
    skips: Skips = field(default_factory=Skips)

    @property
    def skipped(self) -> dict[str, int]:
        """How many were passed over, by cause (the causes that happened)."""
        return {cause: n for cause in CAUSES if (n := self.skips.counts.get(cause, 0))}


#: How a scan keys a record's side: ``VERSION``, by its prompt_version; a float, 'before' when time_s is
#: less than it, else 'after'; ``None``, no key (one side: every group's key is None).
VERSION = "version"
By = float | str | None


class Source(Protocol):
    """Records read back: grouped facts of the records that pass a filter."""

    def close(self) -> None:
        """Release what the source holds (an engine, a connection)."""
        ...

    def scan(self, where: Filter, by: By) -> Scan:
        """The records that pass ``where``, grouped by side key, route and shape."""
        ...

    def count_met(
        self, where: Filter, by: By, limits: dict[tuple[str, str], dict[str, float]]
    ) -> dict[tuple[str | None, str, str], int]:
        """Per (key, route, shape) of ``limits``: ok records whose every limited figure is within its limit
        (a null tpot counts as 0, so does a null ttft of a record that is not a stream; any other null as
        missed): how the proxy would judge them by other objectives."""
        ...


def count_request_objective(g: Group, figure: str, outcome: str | None, n: int = 1) -> None:
    """Add ``n`` records of ``figure``'s request objective with ``outcome`` to the group (none: not counted)."""
    if outcome in REQUEST_OUTCOMES and n > 0:
        counts = g.request_objectives.setdefault(figure, {})
        counts[outcome] = counts.get(outcome, 0) + n


def slowest(parts: list[list[tuple[float, str]]], n: int = SLOWEST) -> list[tuple[float, str]]:
    """The ``n`` slowest of several groups' slowest, in ``Group.slowest``'s order."""
    return sorted((x for p in parts for x in p), key=lambda x: (-x[0], x[1]))[:n]


#: The sources ``open_source`` knows, by the name ``--engine`` gives them.
ENGINES = ("duckdb", "python")
#: The modules each engine needs beyond llmtap's own dependencies.
_NEEDS = {"duckdb": ("duckdb", "numpy"), "python": ()}
#: How to install what the embedded engine needs (an extra: the serve image leaves it out).
ANALYSIS_EXTRA = "pip install 'llmtap[analysis]'"


def engine_installed(engine: str) -> bool:
    """Whether the modules ``engine`` needs are installed (without importing them)."""
    return all(importlib.util.find_spec(module) is not None for module in _NEEDS[engine])


def default_engine() -> str:
    """The engine that reads records when none is named: the embedded one when installed, else plain Python."""
    return next(engine for engine in ENGINES if engine_installed(engine))


def open_source(paths: list[str], engine: str | None = None) -> Source:
    """The record files ``paths`` name, read by ``engine`` (``default_engine()`` for None); ``files.NoRecords``
    when there is none, ``ValueError`` for an engine unknown or not installed."""
    engine = default_engine() if engine is None else engine
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is none of {', '.join(ENGINES)}")
    if not engine_installed(engine):
        raise ValueError(
            f"the {engine} engine needs {' and '.join(_NEEDS[engine])}, not installed here: {ANALYSIS_EXTRA} "
            "(or --engine python, which reads small record sets as well)"
        )
    if engine == "python":
        from llmtap.store.python import PythonSource

        return PythonSource(paths)
    from llmtap.store.engine import EngineSource

    return EngineSource(paths)
