"""``bench.probes.tail``: a made scheduler trace, the relay's waits for the core attributed by hand."""

from __future__ import annotations

from bench.probes import tail

RELAY, WORKER, OTHER = 100, 201, 300
LABEL = {RELAY: "relay", 200: "telemetry", WORKER: "telemetry:llmtap-telemetr"}


def _switch(t: float, comm: str, tid: int, cpu: int = 0) -> str:
    return (
        f"   x 1 [{cpu:03d}] {t:.6f}: sched:sched_switch: prev_comm=a prev_pid=1 prev_prio=120 prev_state=S"
        f" ==> next_comm={comm} next_pid={tid} next_prio=120"
    )


def _wakeup(t: float, tid: int) -> str:
    return f"   x 1 [001] {t:.6f}: sched:sched_wakeup: comm=llmtap-relay pid={tid} prio=120 target_cpu=000"


TRACE = [
    # The relay runs, sleeps; woken at 10.010 while the telemetry's worker holds the core until 10.011.
    _switch(10.000, "llmtap-relay", RELAY),
    _switch(10.002, "llmtap-telemetr", WORKER),
    _wakeup(10.010, RELAY),
    _switch(10.011, "llmtap-relay", RELAY),
    # Woken at 10.020 while another process holds the core, then the telemetry: not the telemetry's alone.
    _switch(10.015, "mypy", OTHER),
    _wakeup(10.020, RELAY),
    _switch(10.0205, "llmtap-telemetr", WORKER),
    _switch(10.021, "llmtap-relay", RELAY),
    # Woken on an idle core, in at once.
    _switch(10.025, "swapper/0", 0),
    _wakeup(10.030, RELAY),
    _switch(10.03001, "llmtap-relay", RELAY),
    _switch(10.040, "x", 1),
]


def test_each_wait_is_attributed_to_who_held_the_core() -> None:
    cores = tail.switches(TRACE)
    assert set(cores) == {0}
    woken = tail.wakeups(TRACE, RELAY)
    assert woken == [10.010, 10.020, 10.030]
    got = tail.waits(cores[0], woken, RELAY, LABEL, [(10.0095, 0.003, 1)])
    assert got["wakeups"] == 3
    assert got["max_ms"] == 1.0
    # Only the first wait was the telemetry's alone, and a collection of the telemetry overlapped it.
    assert got["telemetry_held"]["count"] == 1
    assert got["telemetry_held"]["max_ms"] == 1.0
    assert got["telemetry_held"]["in_telemetry_gc"] == 1
    assert got["over_0.5ms"] == 2
    held = got["over_0.5ms_held_by_ms"]
    assert round(held["telemetry:llmtap-telemetr"], 3) == 1.5 and round(held["other:mypy"], 3) == 0.5


def test_a_request_window_splits_by_label_and_other_commands() -> None:
    cores = tail.switches(TRACE)
    got = tail.held(cores[0], 10.014, 10.026, LABEL)
    assert {k: round(v * 1000, 3) for k, v in got.items()} == {
        "relay": 5.0,  # 10.014 to 10.015, 10.021 to 10.025
        "other:mypy": 5.5,
        "telemetry:llmtap-telemetr": 0.5,
        "idle": 1.0,
    }
