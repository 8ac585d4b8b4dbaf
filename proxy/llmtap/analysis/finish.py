"""One finished request analysed whole, in one call: its summary, cost and cache diagnosis, made once.

A telemetry process keeps one ``Analysis``: the state that must see every request in the order they end (the
queue/prefill estimator's slot replay, the cache diagnosis's index of recent prompts, the drift sampling's clock
per route) and the prices. ``finish`` takes a finished timeline and gives back a ``Finished``: the summary
(tiktoken counts, phases, the SLO), its cost and its cache class filled in, and the diagnosis the cache class came
from. Nothing after it completes the summary but the upstream's own span, where one comes (``adopt_server_timing``,
the server's phases over the estimate): the emitters only read.

Where several telemetry processes share an upstream's requests, what each request taught the estimator and the
cache index waits in ``lessons`` for the others (``llmtap.wire.lessons``).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from llmtap.analysis.cachediag import CacheDiagnoser, Diagnosis
from llmtap.analysis.cost import PriceTable, request_cost
from llmtap.analysis.estimator import Estimator
from llmtap.analysis.slots import Slots
from llmtap.analysis.summary import Summary, drift_possible, summarize
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Settings
from llmtap.wire.lessons import Lesson

__all__ = ["DRIFT_EVERY", "Analysis", "Finished"]

log = logging.getLogger("llmtap.telemetry")

#: Where usage reports the input or the output, tiktoken's drift from it is measured on at most one request per route
#: in this many seconds (the requests' own clock): it takes a whole prompt's count (about 1 ms for 6,000 tokens) and
#: the whole output's (about 0.1 ms for 100 tokens, a tenth of a 50-chunk request's telemetry), costs per request the
#: token figures themselves do not need, and one sample a second per route describes the drift.
DRIFT_EVERY = 1.0


class Finished(NamedTuple):
    """One request, done: its timeline, its summary (cost and cache class in it) and its cache diagnosis (None: none
    was made).

    Immutable itself (a named tuple: the cheapest to make, once per request). The one thing an emitter adds: the
    ids the root span gives a timeline that came without any (one not from a relay: tools, tests), which the
    metrics' exemplars and the record line then carry; so the spans go first."""

    tl: Timeline
    summary: Summary
    diagnosis: Diagnosis | None


class Analysis:
    """The analysis of one telemetry process's finished requests; used on its worker thread only."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.routes = {r.name: r for r in settings.routes}
        #: Splits upstream TTFT into queue and prefill.
        self.estimator = Estimator()
        #: Fingerprints prompts and classifies their cache use.
        self.cache = CacheDiagnoser(settings.routes)
        #: The shipped prices with the user's file over them (``--prices``), for each request's cost.
        self.prices = PriceTable(settings.attribution.prices)
        self._drift_at: dict[str, float] = {}  # route: when its last drift was measured

    def finish(self, tl: Timeline, slots: Slots | None = None) -> Finished:
        """``tl`` analysed whole (``slots``: its upstream's slot count as learned, where the route sets none).

        Call it for every request in the order they end: the estimator replays admissions, the cache index
        learns each prompt once its prefill is done."""
        s = summarize(
            tl,
            self.settings.slo,
            estimator=self.estimator,
            route=self.routes.get(tl.route),
            shapes=self.settings.shapes,
            slots=slots,
            drift=self._drift_due(tl),
        )
        if tl.protocol is not None:
            s.cost = request_cost(self.prices, tl, s)
        diagnosis = self._diagnose(tl, s)
        if diagnosis is not None:
            s.cache_class = diagnosis.cache_class
        return Finished(tl, s, diagnosis)

    def share(self) -> None:
        """Keep what each request teaches for the other telemetry processes (``lessons``)."""
        self.estimator.learned = []
        self.cache.learned = []

    def lessons(self) -> list[Lesson]:
        """What the requests taught since the last call (empty unless ``share`` was called)."""
        out: list[Lesson] = []
        for learned in (self.estimator.learned, self.cache.learned):
            if learned:
                out.extend(learned)
                learned.clear()
        return out

    def _diagnose(self, tl: Timeline, s: Summary) -> Diagnosis | None:
        try:
            return self.cache.diagnose(tl, s)
        except Exception:
            log.exception("telemetry: could not diagnose the cache use of %s %s", tl.method, tl.path)
            return None

    def _drift_due(self, tl: Timeline) -> bool:
        if not drift_possible(tl):
            return False
        last = self._drift_at.get(tl.route)
        if last is not None and 0.0 <= tl.received - last < DRIFT_EVERY:
            return False
        if len(self._drift_at) >= len(self.routes) + 64:  # routes are configured; bounded all the same
            self._drift_at.clear()
        self._drift_at[tl.route] = tl.received
        return True
