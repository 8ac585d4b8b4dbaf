"""The telemetry walk of one finished request, from the intake to the emitters, watched frame by frame.

The recorder hands a finished timeline to the analysis once (``Analysis.finish``) and gets the finished request back
whole; the analysis never calls up into the telemetry side, and the emitters only read what came back: attributes of
plain data, with no call into the analysis at all. Watched with
``sys.setprofile`` while the recorder takes one tape the way its worker does (``dispatch``, then ``idle``), in this
thread, so that a second trip into the analysis's work, or a call back up, fails here rather than in a profile.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmtap.config.types import Route, Settings
from llmtap.telemetry.recorder import Recorder
from tests.support.tapes import chat_tape, content_event

ANALYSIS = "llmtap.analysis"
TELEMETRY = "llmtap.telemetry"
#: The one call of the walk into the analysis's work: summary, cost and cache class, made once.
FINISH = ("llmtap.analysis.finish", "Analysis.finish")
#: What the intake calls while it fills the timeline it plays back: the timeline's own methods and the cost a
#: gateway states in a header (parsed as the headers are read).
FILLING = {"llmtap.analysis.timeline", "llmtap.analysis.cost"}


def _own_side(frame: FrameType) -> str | None:
    """The side the frame's own module is of: analysis, telemetry, or neither."""
    module = frame.f_globals.get("__name__", "")
    for side in (ANALYSIS, TELEMETRY):
        if module.startswith(side + "."):
            return side
    return None


@dataclass
class Walk:
    """Every crossing between the two sides: calls down into the analysis and calls back up into telemetry.

    The side a frame runs on is its own module's, or, for a frame of neither (the standard library, the SDK), its
    caller's: kept as a stack, one entry a Python frame entered while watched."""

    down: list[tuple[str, str]] = field(default_factory=list)
    up: list[tuple[str, str]] = field(default_factory=list)
    returns: int = 0
    _stack: list[str | None] = field(default_factory=lambda: [None])

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        """``sys.setprofile``'s hook: a Python call whose caller runs on the other side is a crossing."""
        if event == "call":
            caller = self._stack[-1]
            own = _own_side(frame)
            self._stack.append(own or caller)
            if own is None or caller is None or own == caller:
                return
            where = (frame.f_globals["__name__"], frame.f_code.co_qualname)
            (self.down if own == ANALYSIS else self.up).append(where)
        elif event == "return" and len(self._stack) > 1:
            here = self._stack.pop()
            self.returns += here == ANALYSIS and self._stack[-1] == TELEMETRY


@pytest.fixture
def recorder() -> Iterator[tuple[Recorder, InMemorySpanExporter, InMemoryMetricReader]]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    settings = Settings(routes=(Route(prefix="/", upstream="http://upstream:8000", name="default"),))
    rec = Recorder(settings, tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader]))
    yield rec, spans, reader
    rec.close()


def test_one_request_goes_down_into_the_analysis_once_and_back_once(
    recorder: tuple[Recorder, InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    rec, spans, reader = recorder
    reads = [content_event(" alpha"), content_event(" beta gamma"), b"data: [DONE]\n\n"]
    # A first request, unwatched, loads what is loaded once (the tokenizer, the instruments' first points).
    for message in chat_tape(1, reads)[1]:
        rec.dispatch(0, message)
    rec.idle(trim=False)
    spans.clear()
    _, messages = chat_tape(2, reads)
    walk = Walk()
    sys.setprofile(walk.profile)
    try:
        for message in messages:
            rec.dispatch(0, message)
        rec.idle(trim=False)  # what the worker does once its queue is empty: the held request goes out
    finally:
        sys.setprofile(None)

    # The walk reached the emitters: the request is recorded, its spans and metrics written.
    assert rec.recorded == 2 and rec.failed == 0
    assert spans.get_finished_spans()
    assert reader.get_metrics_data() is not None
    # The analysis never calls up into telemetry, so each call down comes back before telemetry runs again.
    assert walk.up == []
    assert walk.returns == len(walk.down)
    # Down into the analysis's work once, and back once.
    assert walk.down.count(FINISH) == 1
    finish = walk.down.index(FINISH)
    # Before it, only the timeline being filled; after it, nothing of the analysis: the emitters read plain data.
    filling, after = walk.down[:finish], walk.down[finish + 1 :]
    assert filling and {module for module, _ in filling} <= FILLING, filling
    assert after == [], after


def _module(name: str, source: str) -> dict[str, Any]:
    """The functions of ``source`` as if defined in module ``name`` (their frames say that module)."""
    namespace: dict[str, Any] = {"__name__": name}
    exec(source, namespace)
    return namespace


def test_the_watch_sees_a_second_trip_down_and_a_call_back_up() -> None:
    """The hook itself, on stand-in modules of both sides: telemetry that goes down twice, into an analysis step that
    calls back up, is seen doing both (otherwise the test above could not fail)."""
    learner = _module(TELEMETRY + ".learner", "def learn():\n    return 1\n")["learn"]
    step = _module(ANALYSIS + ".step", "def step(learn):\n    return learn()\n")["step"]
    walk_twice = _module(TELEMETRY + ".walker", "def walk(step, learn):\n    return step(learn) + step(learn)\n")
    walk = Walk()
    sys.setprofile(walk.profile)
    try:
        assert walk_twice["walk"](step, learner) == 2
    finally:
        sys.setprofile(None)
    assert walk.down == [(ANALYSIS + ".step", "step")] * 2
    assert walk.up == [(TELEMETRY + ".learner", "learn")] * 2
    assert walk.returns == 2
