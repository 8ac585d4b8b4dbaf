"""The loss counters' totals across telemetry restarts, and the lines that say losses with their count
(``llmtap.telemetry.journal.losses``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from llmtap.telemetry.journal import losses as losses_module
from llmtap.telemetry.journal.losses import STATE_FILE, Losses


class FakeCounter:
    """A counter that sums what is added, by reason."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def add(self, n: int, attributes: dict[str, Any] | None = None) -> None:
        reason = (attributes or {}).get("reason", "")
        self.values[reason] = self.values.get(reason, 0) + n


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _process(path: Path | None, clock: Clock | None = None) -> tuple[Losses, dict[str, FakeCounter]]:
    counters = {"tapes": FakeCounter(), "records": FakeCounter(), "recovered": FakeCounter()}
    losses = Losses(counters, "reason", clock=clock or Clock())  # type: ignore[arg-type]
    if path is not None:
        losses.keep(path)
    return losses, counters


def test_counters_go_on_from_the_last_runs_totals(tmp_path: Path) -> None:
    state = tmp_path / STATE_FILE
    first, _ = _process(state)
    first.add("records", "no_space", 5)
    first.add("recovered", "", 2, sync=True)  # written at once
    second, counters = _process(state)
    assert counters["records"].values == {"no_space": 5}
    assert counters["recovered"].values == {"": 2}
    second.add("records", "no_space", 1)
    second.close()
    _, counters = _process(state)
    assert counters["records"].values == {"no_space": 6}


def test_a_relays_totals_sent_again_to_a_new_process_add_only_their_rise(tmp_path: Path) -> None:
    """The relay's running total of drops (22, then 30 to the next process, then 34): counted 34, not 22+30+34."""
    state = tmp_path / STATE_FILE
    first, counters = _process(state)
    assert first.relay(7, 22) == 22
    first.save()
    second, counters = _process(state)
    assert second.relay(7, 30) == 8
    assert second.relay(7, 34) == 4
    assert counters["tapes"].values == {"channel_full": 22 + 8 + 4}
    second.save()
    _, counters = _process(state)
    assert counters["tapes"].values == {"channel_full": 34}


def test_a_relay_started_again_counts_from_zero(tmp_path: Path) -> None:
    losses, counters = _process(tmp_path / STATE_FILE)
    losses.relay(7, 10)
    assert losses.relay(7, 3) == 3
    assert losses.relay(8, 5) == 5
    assert counters["tapes"].values == {"channel_full": 18}


def test_a_kill_leaves_the_counts_of_at_most_the_last_save(tmp_path: Path) -> None:
    state = tmp_path / STATE_FILE
    clock = Clock()
    losses, _ = _process(state, clock)
    losses.add("tapes", "queue_full", 3)
    clock.now += losses_module.SAVE_EVERY
    losses.tick()  # what the thread does every SAVE_EVERY seconds
    assert json.loads(state.read_text())["counts"] == {"tapes": {"queue_full": 3}}


def test_an_unreadable_state_file_counts_from_zero_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / STATE_FILE
    state.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="llmtap.telemetry"):
        _, counters = _process(state)
    assert counters["records"].values == {}
    assert "unreadable" in caplog.text


def test_losses_are_said_with_their_count_at_most_every_say_every_and_at_shutdown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    losses, _ = _process(None, clock)
    spans = {"export_failed": 0}
    losses.watch("spans", lambda: dict(spans))
    with caplog.at_level(logging.WARNING, logger="llmtap.telemetry"):
        losses.add("records", "no_space", 4)
        spans["export_failed"] = 10
        clock.now = 1.0
        losses.tick()
        first = caplog.messages[:]
        losses.add("records", "no_space", 3)
        clock.now = 2.0
        losses.tick()
        assert caplog.messages == first, "a second line within SAY_EVERY"
        clock.now = 1.0 + losses_module.SAY_EVERY
        losses.tick()
        spans["export_failed"] = 12
        losses.close()
    lines = caplog.messages
    assert "telemetry: 4 records lost (no_space) in the last 1.0 s; 4 since start" in lines
    assert "telemetry: 10 spans lost (export_failed) in the last 1.0 s; 10 since start" in lines
    assert "telemetry: 3 records lost (no_space) in the last 10.0 s; 7 since start" in lines
    assert "telemetry: 2 spans lost (export_failed) at shutdown, since the last line; 12 since start" in lines
    assert len(lines) == 4


def test_what_a_killed_run_counted_and_never_said_is_said_by_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / STATE_FILE
    first, _ = _process(state)
    first.add("tapes", "in_transit", 32, sync=True)  # then killed before its next line
    with caplog.at_level(logging.WARNING, logger="llmtap.telemetry"):
        second, _ = _process(state)
    assert "the last run counted and was stopped before it said: 32 tapes lost (in_transit)" in caplog.text
    second.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmtap.telemetry"):
        _process(state)
    assert "stopped before it said" not in caplog.text
