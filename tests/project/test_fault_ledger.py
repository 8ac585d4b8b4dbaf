"""The fault suite's own arithmetic (``tests.support.fault_ledger``): what it reads of ``/metrics`` and of the log,
and the sum each fault is judged by."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fault_ledger import RECORDS, TAPES, Counters, Ledger, check, ledger, loss_lines, read_folder, samples
from tests.support.fault_load import Outcome, begun_after

PAGE = """# HELP llmtap_telemetry_tapes_dropped_total Tapes.
# TYPE llmtap_telemetry_tapes_dropped_total counter
llmtap_telemetry_tapes_dropped_total{llmtap_telemetry_reason="channel_full"} 3.0
llmtap_telemetry_tapes_dropped_total{llmtap_telemetry_reason="partial"} 9.0
llmtap_telemetry_tapes_dropped_total{llmtap_telemetry_reason="in_transit"} 1.0
llmtap_telemetry_records_dropped_total{llmtap_telemetry_reason="no_space"} 2.0
llmtap_telemetry_records_dropped_total{llmtap_telemetry_reason="clickhouse_unsent"} 5.0
llmtap_requests_total{llmtap_route="a\\"b"} 4.0 # {trace_id="ab"} 1.0 1700000000.0
llmtap_telemetry_start_time_seconds 100.0
"""


def _counters(*pages: str, url: str = "u") -> Counters:
    counters = Counters(list)
    for page in pages:
        counters._add(url, samples(page))
    return counters


def test_samples_keep_labels_and_leave_out_comments_and_exemplars() -> None:
    got = samples(PAGE)
    assert got[("llmtap_requests_total", (("llmtap_route", 'a\\"b'),))] == 4.0
    assert got[(TAPES, (("llmtap_telemetry_reason", "channel_full"),))] == 3.0
    assert not any(name.startswith("#") for name, _ in got)


def test_losses_count_whole_tapes_and_the_sinks_own_reasons() -> None:
    counters = _counters(PAGE)
    whole = {"tape:channel_full": 3, "tape:in_transit": 1}
    assert counters.losses("files") == whole | {"record:no_space": 2}
    assert counters.losses("clickhouse") == whole | {"record:clickhouse_unsent": 5}


def test_a_counter_that_falls_was_reset_and_counts_again_from_zero() -> None:
    later = PAGE.replace("} 3.0", "} 7.0")
    reset = PAGE.replace("} 3.0", "} 1.0")
    counters = _counters(PAGE, later, reset)
    assert counters.value(TAPES, llmtap_telemetry_reason="channel_full") == 7 + 1
    assert counters.resets >= 1


def test_a_new_start_time_is_a_restart_whose_counters_go_on() -> None:
    """llmtap's loss counters go on across a telemetry restart (``llmtap.telemetry.journal.losses``): only the rise
    counts, as Prometheus' ``increase()`` reads it; the restart is noted."""
    restarted = PAGE.replace("} 3.0", "} 4.0").replace("_seconds 100.0", "_seconds 200.0")
    counters = _counters(PAGE, restarted)
    assert counters.value(TAPES, llmtap_telemetry_reason="channel_full") == 4
    assert counters.value(RECORDS) == 2 + 5
    assert counters.restarts == 1
    assert counters.resets == 0


def test_loss_lines_need_a_count_and_a_word_of_loss() -> None:
    log = "\n".join(
        [
            "record journal: 12 records of the last run recovered, 3 could not be",
            "ClickHouse records: records queue up to 100000 and past that are dropped and counted",
            "record folder written again; 6 records were lost",
            "telemetry process 0 exited with code -9; starting it again",
        ]
    )
    assert loss_lines(log) == [log.splitlines()[0], log.splitlines()[2]]


def _book(recorded: int, counted: int, said: list[str]) -> Ledger:
    return Ledger("f", "files", 10, 0, 0, recorded, 0, 0, {"tape:channel_full": counted} if counted else {}, said)


@pytest.mark.parametrize(
    ("recorded", "counted", "said", "fails"),
    [
        (10, 0, [], None),
        (7, 3, ["3 records lost"], None),
        (7, 2, ["2 records lost"], "1 lost without a count"),
        (7, 4, ["4 records lost"], "-1 lost without a count"),
        (7, 3, [], "no log line says so"),
    ],
)
def test_the_verdict(recorded: int, counted: int, said: list[str], fails: str | None) -> None:
    book = _book(recorded, counted, said)
    if fails is None:
        check(book)
    else:
        with pytest.raises(AssertionError, match=fails):
            check(book)


def test_a_request_cut_before_any_answer_may_be_counted_or_not() -> None:
    book = Ledger("f", "files", 8, 2, 0, 8, 0, 0, {"tape:in_flight": 1}, ["1 request lost"], unsure=2)
    check(book)  # 2 missing, 1 counted: the other may never have reached llmtap
    book.counted = {"tape:in_flight": 3}
    with pytest.raises(AssertionError, match="-1 lost without a count"):
        check(book)


def test_a_ledger_counts_each_request_once_and_a_refused_one_with_a_record_as_sent(tmp_path: Path) -> None:
    outcomes = [
        Outcome("a" * 32, "answered", 200, None),
        Outcome("b" * 32, "cut", None, "reset"),
        Outcome("c" * 32, "refused", None, "refused"),
        Outcome("d" * 32, "refused", None, "refused"),
    ]
    kept = {"a" * 32: {"1"}, "c" * 32: {"3"}, "e" * 32: {"4"}}
    book = ledger("f", "files", outcomes, kept, Counters(list), "", copies=1)
    assert (book.sent, book.recorded, book.copies, book.foreign, book.refused) == (3, 2, 1, 1, 1)
    assert (book.uncounted, book.unsure) == (1, 1)  # b: cut before any answer, with no record and no count


def test_records_are_read_with_llmtaps_reader_and_each_copy_counted(tmp_path: Path) -> None:
    line = '{"llmtap_record": 2, "trace_id": "%s", "span_id": "%s"}\n'
    (tmp_path / "a.jsonl").write_text(line % ("t1", "s1") + line % ("t1", "s1") + line % ("t2", "s2") + '{"llm')
    found = read_folder(tmp_path)
    assert found.traces == {"t1": {"s1"}, "t2": {"s2"}}
    assert (found.copies, found.stats.truncated) == (1, 1)


def test_a_request_begun_after_the_kill_reached_no_llmtap() -> None:
    cut_before = Outcome("a" * 32, "cut", None, "reset", began=1.0)
    cut_after = Outcome("b" * 32, "cut", None, "reset", began=3.0)
    answered = Outcome("c" * 32, "answered", 200, None, began=3.0)
    got = begun_after([cut_before, cut_after, answered], 2.0)
    assert [o.kind for o in got] == ["cut", "refused", "answered"]
