"""``bench.probes.burst_windows``: a made trace and made burst records, attributed by hand."""

from __future__ import annotations

import json
from pathlib import Path

from bench.probes import burst_windows as bw


def _switch(t: float, comm: str, tid: int) -> str:
    return (
        f"   x 1 [000] {t:.6f}: sched:sched_switch: prev_comm=a prev_pid=1 prev_prio=120 prev_state=S"
        f" ==> next_comm={comm} next_pid={tid} next_prio=120"
    )


TRACE = [
    _switch(10.000, "llmtap-relay", 100),
    _switch(10.004, "llmtap-telemetr", 200),
    _switch(10.005, "mypy", 300),
    _switch(10.007, "swapper/0", 0),
    _switch(10.010, "llmtap-relay", 100),
    _switch(10.030, "swapper/0", 0),
    _switch(10.100, "x", 1),
]


def _records(folder: Path) -> None:
    client = [
        {"id": "a", "burst": 0, "release": 10.000, "start": 10.000, "sent": 10.001, "times": [10.028]},
        {"id": "b", "burst": 0, "release": 10.000, "start": 10.000, "sent": 10.002, "times": [10.031]},
    ]
    upstream = [
        {"id": "a", "arrived": 10.003, "sent": [10.023]},
        {"id": "b", "arrived": 10.008, "sent": [10.026]},
    ]
    (folder / "records-burst-llmtap-http-64.json").write_text(json.dumps({"client": client, "upstream": upstream}))


def test_each_window_is_charged_to_whoever_had_the_core(tmp_path: Path) -> None:
    _records(tmp_path)
    cut = bw.slices(TRACE)
    assert [s.comm for s in cut][:3] == ["llmtap-relay", "llmtap-telemetr", "mypy"]
    rows = bw.report(cut, tmp_path, {100: "relay:MainThread", 200: "telemetry:llmtap-recorder"})
    assert len(rows) == 1
    row = rows[0]
    # Starts: release 10.000 to the last arrival 10.008.
    starts = row["starts"]
    assert abs(starts["ms"] - 8.0) < 1e-6
    assert abs(starts["relay:MainThread"] - 4.0) < 1e-6
    assert abs(starts["telemetry:llmtap-recorder"] - 1.0) < 1e-6
    assert abs(starts["other:mypy"] - 2.0) < 1e-6
    assert abs(starts["idle"] - 1.0) < 1e-6
    # First chunks: the upstream's first 10.023 to the client's last 10.031, relay until 10.030 then idle.
    firsts = row["first_chunks"]
    assert abs(firsts["relay:MainThread"] - 7.0) < 1e-6 and abs(firsts["idle"] - 1.0) < 1e-6
    # The slowest request is b: 31 ms to its first chunk less the upstream's 18, connect 2, 6 to the upstream.
    assert abs(row["added"] - 13.0) < 1e-6 and abs(row["connect"] - 2.0) < 1e-6
    assert abs(row["to_upstream"] - 6.0) < 1e-6 and abs(row["back"] - 5.0) < 1e-6
    table = bw.markdown(rows)
    assert (
        "| llmtap-http-64 | 1 | 13.0 / 2.0 / 6.0 / 5.0 | 8.0: 4.0 / 1.0 / 2.0 / 1.0 | 8.0: 7.0 / 0.0 / 0.0 / 1.0 |"
        in table
    )


def test_a_burst_outside_the_trace_is_left_out(tmp_path: Path) -> None:
    _records(tmp_path)
    assert bw.report(bw.slices(TRACE[:3]), tmp_path, {}) == []
