"""The lessons one telemetry process tells the others: their kinds, their named fields, an encode/decode pair.

Where several telemetry processes share an upstream's requests (``llmtap.telemetry.fleet.siblings``), what one
request taught the state kept whole per upstream travels to the others inside a ``Facts`` message
(``llmtap.wire.messages``), a batch of lessons. Seven kinds: three the queue/prefill estimator learns
(``Decoding``, ``Ended``, ``Idle``), one the cache diagnosis learns (``Prefix``), one the slot count
(``SlotCount``), and two that go to one process only (``LiveEntry`` to process 0's live view, ``PassedSpans`` to
the process that recorded their requests). Encoded, a lesson is a plain tuple, its kind's name first, so
``marshal`` carries it; decoding checks the kind, the field count and each field's type, and raises
``WireError`` for one this build cannot read (each lesson on its own: one bad lesson costs only itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

from llmtap.wire.messages import WireError

__all__ = [
    "Decoding",
    "Ended",
    "Idle",
    "Lesson",
    "LiveEntry",
    "PassedSpans",
    "Prefix",
    "SlotCount",
    "decode_lesson",
    "encode_lesson",
]


class Decoding(NamedTuple):
    """A request to ``upstream`` decoded from ``first`` (its first content) to ``end`` (the estimator's slot log)."""

    upstream: str
    first: float
    end: float


class Ended(NamedTuple):
    """A request to ``upstream`` went onto its connection at ``written`` and ended at ``end`` (the slot log)."""

    upstream: str
    written: float
    end: float


class Idle(NamedTuple):
    """A request sent to an idle ``upstream``: its uncached prompt ``tokens`` and its TTFT (the unloaded envelope of
    ``model``; ``rate``: the decode rate it was seen at, None when unknown)."""

    upstream: str
    model: str
    tokens: int
    ttft: float
    rate: float | None


class Prefix(NamedTuple):
    """A prompt the cache diagnosis indexed: its block chain's digests, and when its prefill was done."""

    digests: tuple[bytes, ...]
    ready: float


class SlotCount(NamedTuple):
    """The slot count of ``upstream`` learned from its gauges (``llmtap.analysis.slots.Slots``)."""

    upstream: str
    slots: int
    source: str
    confidence: float


class LiveEntry(NamedTuple):
    """A finished request for process 0's live view (``llmtap.telemetry.admin.live.window``'s entry, a plain
    tuple)."""

    entry: tuple[Any, ...]


class PassedSpans(NamedTuple):
    """An upstream's spans for the process that recorded their requests: an OTLP ``ExportTraceServiceRequest``'s
    bytes (process 0's admin listener received them)."""

    export: bytes


Lesson: TypeAlias = Decoding | Ended | Idle | Prefix | SlotCount | LiveEntry | PassedSpans

_new = tuple.__new__


def _number(x: object) -> bool:
    return type(x) is float or type(x) is int


def _text(x: object) -> bool:
    return type(x) is str


def _digests(x: object) -> bool:
    return type(x) is tuple and all(type(d) is bytes for d in x)


def _rate(x: object) -> bool:
    return x is None or _number(x)


def _integer(x: object) -> bool:
    return type(x) is int


def _entry(x: object) -> bool:
    return type(x) is tuple


def _bytes(x: object) -> bool:
    return type(x) is bytes


#: Each kind: its name on the wire, and a check per field.
_KINDS: dict[type[Any], tuple[str, tuple[Callable[[object], bool], ...]]] = {
    Decoding: ("decoding", (_text, _number, _number)),
    Ended: ("ended", (_text, _number, _number)),
    Idle: ("idle", (_text, _text, _integer, _number, _rate)),
    Prefix: ("prefix", (_digests, _number)),
    SlotCount: ("slots", (_text, _integer, _text, _number)),
    LiveEntry: ("live", (_entry,)),
    PassedSpans: ("spans", (_bytes,)),
}
_BY_NAME = {name: (cls, checks) for cls, (name, checks) in _KINDS.items()}


def encode_lesson(lesson: Lesson) -> tuple[Any, ...]:
    """A lesson as it crosses: its kind's name, then its fields."""
    return (_KINDS[type(lesson)][0], *lesson)


def decode_lesson(raw: object) -> Lesson:
    """A lesson from its encoded form; ``WireError`` names what is wrong with one this build cannot read."""
    if type(raw) is not tuple or not raw:
        raise WireError(f"a lesson that is not a non-empty tuple: {type(raw).__name__}")
    kind = _BY_NAME.get(raw[0])
    if kind is None:
        raise WireError(f"a lesson of unknown kind {raw[0]!r} (this build knows {sorted(_BY_NAME)})")
    cls, checks = kind
    fields = raw[1:]
    if len(fields) != len(checks):
        raise WireError(f"a {raw[0]} lesson of {len(fields)} fields where this build has {len(checks)}")
    for name, check, value in zip(cls._fields, checks, fields, strict=True):
        if not check(value):
            raise WireError(f"a {raw[0]} lesson whose {name} is a {type(value).__name__}")
    lesson: Lesson = _new(cls, fields)
    return lesson
