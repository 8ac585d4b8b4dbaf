"""A relay's read is taken a slice at a time, with a look at the relays between slices: every message arrives
once, whole and in order, however the slices cut the frames; a broken frame still resets the connection."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

import pytest

from llmtap.telemetry import sched
from llmtap.telemetry.journal.spool import Spool
from llmtap.telemetry.process import INTAKE_SLICE, _Intake
from llmtap.wire.framing import encode_frames
from llmtap.wire.messages import Raw, Stats, encode_stats, ready_of


class _Receiver:
    """Records what the intake queues, and where the looks at the relays fell."""

    spool: Spool | None = None

    def __init__(self) -> None:
        self.batches: list[list[Raw]] = []
        self.events: list[str] = []
        self.ready: list[bool] = []

    def submit(self, message: Raw, source: int = 0) -> bool:
        raise AssertionError("the intake queues a read's messages together")

    def submit_all(self, messages: Sequence[Raw], source: int = 0) -> None:
        self.batches.append(list(messages))
        self.events.append("submit")

    def relay_ready(self, source: int, ready: bool) -> None:
        self.ready.append(ready)

    def relay_gone(self, source: int) -> None:
        pass


class _Transport:
    closed = False

    def close(self) -> None:
        self.closed = True


def _stats(n: int, ready: bool = True) -> Raw:
    """A relay's report, ``n`` telling them apart (its dropped tapes)."""
    return encode_stats(Stats(ready, n, (("default", n % 7),), (), (), (), ()))


def _wire(messages: Sequence[Raw]) -> bytes:
    return b"".join(b"".join(encode_frames(m)) for m in messages)


@pytest.fixture
def looks(monkeypatch: pytest.MonkeyPatch) -> _Receiver:
    receiver = _Receiver()
    monkeypatch.setattr(sched, "checkpoint", lambda: receiver.events.append("look"))
    return receiver


def _intake(receiver: _Receiver) -> _Intake:
    intake = _Intake(receiver, 0, set())
    intake._transport = _Transport()  # type: ignore[assignment]
    return intake


def test_a_read_past_one_slice_is_queued_slice_by_slice_with_a_look_between(looks: _Receiver) -> None:
    sent = [_stats(n) for n in range(4000)]
    data = _wire(sent)
    assert len(data) > 3 * INTAKE_SLICE
    _intake(looks).data_received(data)
    assert [m for batch in looks.batches for m in batch] == sent
    assert len(looks.batches) == -(-len(data) // INTAKE_SLICE)
    # Between two slices' queues, at least one look at the relays with nothing decoded in between.
    submits = [i for i, e in enumerate(looks.events) if e == "submit"]
    for before, after in itertools.pairwise(submits):
        assert looks.events[before + 1] == "look" and "look" in looks.events[before + 1 : after]


def test_a_short_read_is_one_batch(looks: _Receiver) -> None:
    sent = [_stats(n) for n in range(10)]
    _intake(looks).data_received(_wire(sent))
    assert looks.batches == [sent]


def test_frames_the_slices_cut_arrive_whole_and_once(looks: _Receiver) -> None:
    # A message larger than a slice among small ones, the whole sent in reads of odd sizes.
    big = encode_stats(Stats(True, 1, tuple((f"route-{i}", i) for i in range(6000)), (), (), (), ()))
    sent = [_stats(1), big, *(_stats(n) for n in range(2, 900)), big, _stats(901)]
    data = _wire(sent)
    assert len(_wire([big])) > INTAKE_SLICE
    intake = _intake(looks)
    for at in range(0, len(data), 50_001):
        intake.data_received(data[at : at + 50_001])
    assert [m for batch in looks.batches for m in batch] == sent


def test_readiness_is_read_in_every_slice(looks: _Receiver) -> None:
    sent = [_stats(n, ready=n % 2 == 0) for n in range(3000)]
    _intake(looks).data_received(_wire(sent))
    assert looks.ready == [ready_of(m) for m in sent]


def test_a_bad_frame_in_a_later_slice_resets_the_connection_after_what_came_before(looks: _Receiver) -> None:
    good = [_stats(n) for n in range(2000)]
    intake = _intake(looks)
    transport = intake._transport
    intake.data_received(_wire(good) + struct.pack("!I", 5) + b"\x00garb" + _wire(good[:5]))
    assert [m for batch in looks.batches for m in batch] == good
    assert isinstance(transport, _Transport) and transport.closed


class _Journal:
    """A stand-in for the record journal: what each slice's complete frames were, as they came."""

    def __init__(self) -> None:
        self.kept: list[bytes] = []
        self.messages: list[Raw] = []

    def append(self, source: int, data: bytes, messages: Sequence[Raw]) -> None:
        self.kept.append(data)
        self.messages.extend(messages)


def test_the_journal_keeps_every_frame_of_a_sliced_read_once_in_order(looks: _Receiver) -> None:
    journal = _Journal()
    looks.spool = journal  # type: ignore[assignment]
    sent = [_stats(n) for n in range(3000)]
    data = _wire(sent)
    intake = _intake(looks)
    intake.data_received(data[:70_000])
    intake.data_received(data[70_000:])
    assert b"".join(journal.kept) == data
    assert journal.messages == sent == [m for batch in looks.batches for m in batch]
    assert len(journal.kept) > 2
