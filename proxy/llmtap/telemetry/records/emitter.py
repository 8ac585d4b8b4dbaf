"""The records' emitter: each finished request's record line, built once, to every sink; the record journal told
which sink has it."""

from __future__ import annotations

import logging

from llmtap.analysis.finish import Finished
from llmtap.deadline import Deadline
from llmtap.telemetry.identity import Identity
from llmtap.telemetry.journal.spool import SINK_BITS, Spool
from llmtap.telemetry.records.record import record_line
from llmtap.telemetry.records.sinks import Sink

__all__ = ["RecordEmitter"]

log = logging.getLogger("llmtap.telemetry")


class RecordEmitter:
    """Each request's record line, built once, to every sink (``--record``, ``--record-logs``, ClickHouse).

    With the record journal (``spool``), each sink's copy is followed until the sink settles it, and a request the
    last run began goes only to the sinks that lack it."""

    def __init__(self, sinks: list[Sink], identity: Identity) -> None:
        self.sinks = sinks
        self.identity = identity
        #: The record journal, which keeps each request's tape until every sink has its record (None: none).
        self.spool: Spool | None = None
        self._bits = [SINK_BITS.get(getattr(sink, "kind", ""), 0) for sink in sinks]

    def emit(self, request: Finished) -> None:
        """The record line to every sink; a lost record is counted by its sink."""
        if not self.sinks:
            return
        spool, ref = self.spool, request.tl.ref
        try:
            line = record_line(request.tl, request.summary, request.diagnosis, self.identity)
        except Exception:
            if spool is not None:
                spool.settle(ref)  # counted as failed by the recorder: no sink waits for it
            raise
        has = spool.mask_of(ref) if spool is not None else 0
        for i, sink in enumerate(self.sinks):
            if has & self._bits[i]:
                continue
            progress = getattr(sink, "progress", None)
            seq = progress.given if progress is not None else 0
            try:
                sink.write(line)
            except Exception:
                log.exception("telemetry: a record sink failed")
                if progress is not None and progress.given == seq:
                    progress.settle_now()
            if spool is not None and progress is not None:
                spool.track(ref, i, seq)

    def flush(self) -> None:
        """Push what the sinks hold out now (a write that fails is counted and said by its sink, once)."""
        for sink in self.sinks:
            try:
                sink.flush()
            except Exception:
                log.exception("telemetry: a record sink could not flush")

    def close(self, timeout: float) -> None:
        """Close every sink, all within ``timeout`` seconds."""
        deadline = Deadline(timeout)
        for sink in self.sinks:
            try:
                sink.close(deadline.left())
            except Exception:
                log.exception("telemetry: a record sink could not close")
