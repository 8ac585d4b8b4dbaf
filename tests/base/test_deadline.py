"""``llmtap.deadline``: one bound for steps in turn, each given what the ones before left, never less than nothing."""

from __future__ import annotations

import pytest

from llmtap.deadline import Deadline


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_each_step_gets_what_the_steps_before_it_left(clock: Clock) -> None:
    bound = Deadline(2.0, clock)
    assert bound.left() == 2.0 and not bound.passed()
    clock.now += 0.5  # a first step took half a second
    assert bound.left() == pytest.approx(1.5)
    clock.now += 1.5
    assert bound.left() == 0.0 and bound.passed()


def test_a_bound_overrun_leaves_nothing_not_a_negative_wait(clock: Clock) -> None:
    bound = Deadline(1.0, clock)
    clock.now += 7.0  # a step that overran the whole bound
    assert bound.left() == 0.0 and bound.passed()


def test_a_zero_bound_has_passed_at_once(clock: Clock) -> None:
    assert Deadline(0.0, clock).passed() and Deadline(0.0, clock).left() == 0.0
