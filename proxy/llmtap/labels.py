"""Strings from clients and upstreams as telemetry values: made valid and short, and few on metrics.

Model names, response ids and models, error types, finish reasons, stop sequences and prompt versions are
chosen by a client or an upstream, and any JSON string may carry a lone surrogate (``"\\udc80"``), a NUL or
10 KB. ``clean`` makes each one fit to export: protobuf (OTLP) and the Prometheus page are UTF-8, and a
lone surrogate is not, so one such string would fail every export and scrape from then on. ``LabelGuard``
bounds how many distinct values one metric attribute takes, so junk can neither grow the series without
end nor keep a real model out. ``version_label`` says what a client's ``x-llmtap-prompt-version`` (or a route's
version) may become; the settings check a route's configured version with it at start. All are pure; the
guard runs on the telemetry process's recorder thread.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Iterable

__all__ = [
    "INVALID_VERSION",
    "LABEL_CAP",
    "OTHER",
    "VERSION_MAX_BYTES",
    "LabelGuard",
    "clean",
    "clean_list",
    "clean_or_none",
    "version_label",
]

log = logging.getLogger("llmtap.telemetry")

#: Characters a metric label value keeps: real model names are well under 100 (``org/model-name-v1``).
LABEL_CAP = 256
#: Characters a span attribute (or a record's or the live view's field) keeps.
ATTRIBUTE_CAP = 1024
#: Items a list-valued span attribute keeps (stop sequences, finish reasons).
LIST_CAP = 64
OTHER = "_OTHER"
_CUT = "\u2026"
_REPLACEMENT = "\ufffd"
_SURROGATES = re.compile("[\ud800-\udfff]")
# Control characters and line separators too, for labels: a label is an identifier on a page read line by line.
_LABEL_INVALID = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def clean(value: str, cap: int = ATTRIBUTE_CAP, *, label: bool = False) -> str:
    """``value`` fit to export: at most ``cap`` characters (a longer one is cut and ends in ``…``), lone
    surrogates replaced by U+FFFD and, for a metric ``label``, control characters as well."""
    if len(value) > cap:
        value = value[: cap - 1] + _CUT
    if value.isascii() and value.isprintable():
        return value
    return (_LABEL_INVALID if label else _SURROGATES).sub(_REPLACEMENT, value)


def clean_or_none(value: str | None, cap: int = ATTRIBUTE_CAP) -> str | None:
    """``clean(value)``, or None for None (a field that may be absent)."""
    return None if value is None else clean(value, cap)


def clean_list(values: Iterable[str], cap: int = ATTRIBUTE_CAP) -> list[str]:
    """A list-valued attribute: its first ``LIST_CAP`` items, each ``clean``."""
    out: list[str] = []
    for value in values:
        if len(out) == LIST_CAP:
            break
        out.append(clean(value, cap))
    return out


class LabelGuard:
    """The values one metric attribute may carry: the pinned ones, up to ``slots`` frequent ones, else ``_OTHER``.

    Why neither first-come nor a plain top-K: the OpenTelemetry SDK keeps every attribute set it was ever
    given for as long as the process runs (cumulative temporality; there is no way to drop a series), so
    each value that ever had a label keeps its series on ``/metrics`` and in every OTLP export. Keeping the
    first 64 values forever bounds that, but lets the first 64 junk names keep a real model out; a top-K
    that evicts freely would let rotating junk add series without end. So a value has to earn its label,
    and the values that ever had one are what is bounded:

    - Uses are counted with a decay (``half_life``): a value's score is its uses, each halved every
      ``half_life`` seconds, so the values used most lately are the strongest.
    - The first ``trial`` distinct values get a label at their first use (a new proxy shows its first
      models from their first request); every later one only at its second use while it is remembered
      among the ``candidates`` (the weakest candidate is forgotten first). Junk seen once, however much of
      it, holds at most ``trial`` labels; a name sent a second time after one use survives ``candidates``
      other new names between its two uses.
    - When the ``slots`` are full, a value takes the slot of the weakest member once its score is higher
      by a margin of one use (so two values of equal traffic do not swap back and forth); the member is
      evicted (``on_evict``) and may come back the same way.
    - A value that never had a label may only take a member's slot with a token of a budget of
      ``replacements`` that refills at ``replacements`` a day; a value that had a label before comes back
      for free (its series exist already). Without a token it reads ``_OTHER`` (logged once).

    So the distinct values ever labelled are at most ``slots + replacements × (1 + days running)`` plus
    the pinned ones, whatever the traffic, and a real value sent a few times gets its label. Beyond
    that, the SDK's own limit (2,000 attribute sets per instrument, then one ``otel.metric.overflow``
    series) bounds the memory of an attack that keeps rotating frequent junk for days.
    """

    MARGIN = 1.0
    DAY = 86_400.0

    def __init__(
        self,
        name: str,
        slots: int,
        *,
        trial: int,
        candidates: int,
        replacements: int,
        pinned: Iterable[str] = (),
        half_life: float = 3600.0,
        on_evict: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._slots = slots
        self._trial = trial
        self._candidates = candidates
        self._replacements = float(replacements)
        self._pinned = frozenset(clean(v, LABEL_CAP, label=True) for v in pinned)
        self._half_life = half_life
        self._on_evict = on_evict
        self._clock = clock
        # Scores are kept as levels, log2(score) + time / half_life: a level does not change while time
        # passes, so the weakest entry is the one with the lowest level, found without recomputing any.
        self._members: dict[str, float] = {}
        self._waiting: dict[str, float] = {}
        self._ever: set[str] = set()
        self._trials = 0
        self._tokens = self._replacements
        self._filled = clock()
        self._warned = False
        self.evicted = 0

    def _level(self, score: float, now: float) -> float:
        return math.log2(score) + now / self._half_life

    def _score(self, level: float, now: float) -> float:
        return float(2.0 ** (level - now / self._half_life))

    def label(self, value: str) -> str:
        """The label ``value`` has now, without counting a use."""
        value = clean(value, LABEL_CAP, label=True)
        return value if value in self._pinned or value in self._members else OTHER

    def __call__(self, value: str) -> str:
        """Count one use of ``value`` and return its label: itself while it holds a slot, else ``_OTHER``."""
        value = clean(value, LABEL_CAP, label=True)
        if value in self._pinned:
            return value
        now = self._clock()
        level = self._members.get(value)
        if level is not None:
            self._members[value] = self._level(self._score(level, now) + 1.0, now)
            return value
        seen = self._waiting.pop(value, None)
        score = (self._score(seen, now) if seen is not None else 0.0) + 1.0
        if len(self._members) < self._slots:
            if seen is not None or self._trials < self._trial:
                self._trials += seen is None
                self._admit(value, score, now)
                return value
        elif self._challenge(value, score, now):
            return value
        self._wait(value, score, now)
        return OTHER

    def _challenge(self, value: str, score: float, now: float) -> bool:
        """Whether ``value`` takes the weakest member's slot (the slots are full)."""
        weakest = min(self._members, key=self._members.__getitem__)
        weakest_score = self._score(self._members[weakest], now)
        if score <= weakest_score + self.MARGIN:
            return False
        if value not in self._ever and not self._spend(now):
            if not self._warned:
                self._warned = True
                log.warning(
                    "telemetry: new values of %s come faster than %d a day; the newest read %s on metrics "
                    "(spans keep them)",
                    self.name,
                    int(self._replacements),
                    OTHER,
                )
            return False
        del self._members[weakest]
        self._wait(weakest, weakest_score, now)
        self.evicted += 1
        log.debug("telemetry: %s %r lost its label to %r", self.name, weakest, value)
        if self._on_evict is not None:
            self._on_evict(weakest)
        self._admit(value, score, now)
        return True

    def _spend(self, now: float) -> bool:
        """Take one replacement token, if the budget (refilled continuously) has one."""
        refill = (now - self._filled) * self._replacements / self.DAY
        self._tokens = min(self._replacements, self._tokens + refill)
        self._filled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _admit(self, value: str, score: float, now: float) -> None:
        self._members[value] = self._level(score, now)
        self._ever.add(value)

    def _wait(self, value: str, score: float, now: float) -> None:
        self._waiting[value] = self._level(score, now)
        if len(self._waiting) > self._candidates:
            del self._waiting[min(self._waiting, key=self._waiting.__getitem__)]


# Prompt versions

#: A version label longer than this or with control characters is not used as a label.
VERSION_MAX_BYTES = 128
INVALID_VERSION = "invalid"


def version_label(raw: bytes | str | None) -> str | None:
    """A prompt version fit to be a label: None when absent, ``invalid`` when too long or with control characters.

    The request itself always goes through: only the label is refused.
    """
    if raw is None:
        return None
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    data = data.strip(b" ")
    if not data:
        return None
    if len(data) > VERSION_MAX_BYTES or any(b < 0x20 or b == 0x7F for b in data):
        return INVALID_VERSION
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return INVALID_VERSION
