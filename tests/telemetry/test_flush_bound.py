"""On exit, the flush bound (``--flush-timeout``) is one for everything that flushes, not one for each part: a part
that takes its time leaves the next ones less, never the exit more."""

from __future__ import annotations

import time

from llmtap.telemetry.identity import Identity
from llmtap.telemetry.records.emitter import RecordEmitter

ME = Identity(instance_id="host-1-abc", host="host", pid=1)


class Sink:
    """A record sink whose close takes ``takes`` seconds and keeps the bound it was given."""

    kind = "file"

    def __init__(self, takes: float) -> None:
        self.takes = takes
        self.given: float | None = None

    def write(self, line: bytes) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, timeout: float = 5.0) -> None:
        self.given = timeout
        time.sleep(self.takes)


def test_the_sinks_share_one_bound_as_they_close() -> None:
    slow, next_one, last = Sink(0.3), Sink(0.0), Sink(0.0)
    emitter = RecordEmitter([slow, next_one, last], ME)  # type: ignore[list-item]
    emitter.close(1.0)
    assert slow.given is not None and slow.given <= 1.0
    # The slow sink took 0.3 s of the one second: the others are let have what is left, at most.
    assert next_one.given is not None and next_one.given <= 0.7
    assert last.given is not None and last.given <= 0.7


def test_a_sink_that_took_the_whole_bound_leaves_the_others_none_and_no_less_than_none() -> None:
    slow, after = Sink(0.2), Sink(0.0)
    RecordEmitter([slow, after], ME).close(0.1)  # type: ignore[list-item]
    assert after.given == 0.0
