"""The relay's life (``llmtap.relay.lifecycle``): the shutdown waits for the requests in flight to hand over their
tapes, up to ``SETTLE_SECONDS``, and no longer than they take."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from llmtap.relay import lifecycle
from llmtap.relay.lifecycle import Lifecycle
from llmtap.wire.tape import Tape


class _Gauges:
    def __init__(self) -> None:
        self.ready = False
        self.changed = False
        self.active: dict[str, int] = {"chat": 0}
        self.stopped = False

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.stopped = True


class _Channel:
    closed = False

    async def aclose(self) -> None:
        self.closed = True


class _Handover:
    ledger = None

    def __init__(self) -> None:
        self.tapes: list[Tape] = []
        self.channel = _Channel()

    def hand_over(self, tape: Tape) -> None:
        self.tapes.append(tape)


class _Upstreams:
    closed = False

    async def aclose(self) -> None:
        self.closed = True


def _life() -> tuple[Lifecycle, _Handover, _Upstreams]:
    handover, upstreams = _Handover(), _Upstreams()
    gauges: Any = _Gauges()
    return Lifecycle(gauges, handover, upstreams), handover, upstreams  # type: ignore[arg-type]


def _tape() -> Tape:
    return Tape(1, method="POST", path="/v1/x", inner_path="/v1/x", route="chat", protocol=None, received=0.0,
                received_wall_ns=0)  # fmt: skip


async def test_the_shutdown_waits_for_a_request_in_flight_and_no_longer() -> None:
    life, handover, upstreams = _life()
    await life.startup()
    life.begin("chat")
    tape = _tape()

    async def finish() -> None:
        await asyncio.sleep(0.05)
        life.end("chat", tape)

    ending = asyncio.create_task(finish())
    began = time.monotonic()
    await life.shutdown()
    waited = time.monotonic() - began
    await ending
    assert handover.tapes == [tape] and life.inflight == 0
    assert upstreams.closed  # closed only after the tape went
    assert 0.04 <= waited < lifecycle.SETTLE_SECONDS / 2


async def test_the_shutdown_goes_at_once_when_nothing_is_in_flight() -> None:
    life, _, upstreams = _life()
    await life.startup()
    life.begin("chat")
    life.end("chat", _tape())
    began = time.monotonic()
    await life.shutdown()
    assert time.monotonic() - began < 0.5 and upstreams.closed


async def test_the_shutdown_gives_up_on_a_request_that_never_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "SETTLE_SECONDS", 0.1)
    life, handover, upstreams = _life()
    await life.startup()
    life.begin("chat")
    await life.shutdown()
    assert upstreams.closed and handover.tapes == [] and life.inflight == 1
    # Ending after the shutdown gave up on it finds the wait gone: nothing raises.
    life.end("chat", _tape())
    assert life.inflight == 0
