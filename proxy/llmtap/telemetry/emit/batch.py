"""Finished requests to every emitter, a batch at a time.

On the recorder's worker, requests made final while more messages wait in the queue are held, and emitted together
once it is empty or ``STAGED`` are held; a call on another thread (a direct ``record``) emits at once. A batch goes
emitter by emitter rather than request by request: one emitter's code and data stay in the CPU's caches for the
whole batch. Tapes captured in place and played again (``bench.probes.telemetry --tapes --before``) cost 21.6 against
19.5 µs a chunk back to back, and 22.8 against 21.3 and 25.1 against 21.0 handed over 32 messages at a time, 0.32 s
apart. Each emitter still sees the requests in order, the spans first (they give ids to a timeline that came
without any).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from llmtap.analysis.finish import Finished
from llmtap.telemetry import sched
from llmtap.telemetry.emit.finished import Emitter
from llmtap.telemetry.journal.spool import EMITTED, Spool

__all__ = ["LOOK_EVERY", "STAGED", "Emission"]

log = logging.getLogger("llmtap.telemetry")

#: Finished requests the worker holds at most before it emits them: tens of milliseconds of work.
STAGED = 64
#: Requests a batch-taking emitter (the metrics) records together at most. Its recording runs with no look at the
#: relays (``sched.checkpoint``): a batch of ``STAGED`` short requests' metrics held a relay woken on the same core
#: for 0.7 ms (median) to 3.9 ms (``python -m bench.probes.tail``, the stretches between two looks); a quarter of it
#: is a quarter of that, the batch's figures the same (they are those of recording one by one).
LOOK_EVERY = 16


class Emission:
    """The emitters, in order, and the requests held for them on the worker thread."""

    def __init__(self, emitters: Sequence[Emitter], records: Emitter) -> None:
        #: Each finished request goes to these, in this order (the metrics' exemplars read the ids the root span
        #: may have given a timeline without any).
        self.emitters = tuple(emitters)
        #: The records' emitter: the one a request of the last run whose other output was made goes to alone.
        self.records = records
        #: The record journal (None: none): told once each request was emitted.
        self.spool: Spool | None = None
        #: Requests some emitter failed on (logged where it failed).
        self.failed = 0
        self._held: list[Finished] | None = None
        self._worker_id = 0

    def hold_here(self) -> None:
        """The calling thread is the worker: what it makes final is held until ``release``."""
        self._worker_id = threading.get_ident()
        self._held = []

    def stop_holding(self) -> None:
        """The worker is stopping: what it holds goes now, and nothing is held after."""
        self.release()
        self._held = None

    @property
    def held(self) -> int:
        """Requests held now."""
        return len(self._held) if self._held else 0

    def add(self, requests: list[Finished]) -> None:
        """Requests whose summaries are final: held on the worker while more messages wait, else emitted now."""
        if not requests:
            return
        if self._held is not None and threading.get_ident() == self._worker_id:
            self._held.extend(requests)
        else:
            self.emit(requests)

    def release(self) -> None:
        """Emit what is held."""
        held = self._held
        if held:
            self._held = []
            self.emit(held)

    def emit(self, requests: list[Finished]) -> None:
        """Every emitter in turn over all of ``requests``; one that fails is logged and the others still run."""
        failed: set[int] = set()
        spool = self.spool
        # Requests of the last run whose spans, metrics and listeners it made already: their records only.
        made = set() if spool is None else {i for i, r in enumerate(requests) if spool.mask_of(r.tl.ref) & EMITTED}
        for emitter in self.emitters:
            # An emitter that takes a batch whole (the metrics: ``MetricWriter.batch``) is given each request in
            # turn and records them all when the batch is closed, ``LOOK_EVERY`` requests at most.
            batched = getattr(emitter, "batch", None)
            step = LOOK_EVERY if batched is not None else len(requests)
            for start in range(0, len(requests), step):
                part = range(start, min(start + step, len(requests)))
                sink: Any = batched() if batched is not None and len(part) > 1 else emitter
                for i in part:
                    sched.checkpoint()
                    if made and i in made and emitter is not self.records:
                        continue
                    try:
                        sink.emit(requests[i])
                    except Exception:
                        failed.add(i)
                        tl = requests[i].tl
                        log.exception("telemetry: %s failed on %s %s", type(emitter).__name__, tl.method, tl.path)
                if sink is not emitter:
                    try:
                        sink.close()
                    except Exception:
                        failed.update(part)
                        name = type(emitter).__name__
                        log.exception("telemetry: %s failed on a batch of %d requests", name, len(part))
        self.failed += len(failed)
        if spool is not None:
            for request in requests:
                spool.emitted(request.tl.ref)
