"""What the live view's window costs per finished request: ``python -m bench.probes.live_entry --tapes FILE``.

The live view is a listener of the recorder: every recorded request goes through ``LiveWindow.__call__`` on the
recorder's worker thread (its series' tallies, busy time, kept latencies, and its waterfall). This plays the
captured tapes in FILE (``python -m bench.probes.relay_cpu --capture FILE``) through a recorder with the
providers and live view ``llmtap serve`` has by default, keeps the first ``--requests`` finished requests
(timeline and summary), and times the window's call on them again and again in a window of its own: CPU per
request (``time.process_time``), the median of ``--rounds``. Then ``Busy.add`` (a series' busy time) with a whole
horizon of slots kept, as after 15 minutes of traffic, which the tapes' few seconds never reach. Run it under
each tree (``PYTHONPATH=TREE/proxy:.``) in turn to compare them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.probes.telemetry import _served, captured


def _finished(path: Path, requests: int) -> list[tuple[Any, Any]]:
    """The first ``requests`` timelines and summaries the recorder makes of the tapes in ``path``."""
    from llmtap.config.load import build
    from llmtap.telemetry.admin.live.view import LiveView
    from llmtap.telemetry.recorder import Recorder

    settings = build({"upstream": "http://127.0.0.1:9", "provider": "vllm"}, {"OTEL_SERVICE_NAME": "llmtap"})
    tracer_provider, meter_provider, stop = _served(settings)
    recorder = Recorder(settings, tracer_provider=tracer_provider, meter_provider=meter_provider)
    LiveView(recorder, settings)  # the labels' guards learn the models, as in ``llmtap serve``
    got: list[tuple[Any, Any]] = []
    recorder.listeners.append(lambda tl, s: got.append((tl, s)) if len(got) < requests else None)
    for message in captured(path):
        recorder.submit(message)
        if len(got) >= requests:
            break
    recorder.flush(60)
    recorder.close()
    stop()
    return got


def _window_us(finished: list[tuple[Any, Any]], rounds: int) -> float:
    """µs of CPU per request through a fresh live window's listener call, the median of ``rounds``."""
    from llmtap.telemetry.admin.live.window import LiveWindow

    runs = []
    for _ in range(rounds):
        window = LiveWindow(lambda tl, s: (tl.route, "bench", ""), slo=False, traces=False)
        start = time.process_time()
        for tl, s in finished:
            window(tl, s)
        runs.append((time.process_time() - start) / len(finished) * 1e6)
    return statistics.median(runs)


def _busy_us(rounds: int, adds: int = 20_000) -> float:
    """µs of CPU per ``Busy.add`` of a 1 ms request, with a whole horizon of slots kept, the median of ``rounds``."""
    from llmtap.telemetry.admin.live.measures import HORIZON, SLOT, Busy

    runs = []
    for _ in range(rounds):
        busy = Busy()
        t = 10_000.0
        while t < 10_000.0 + HORIZON:  # a request every second for the horizon: every slot kept
            busy.add(t, t + 0.001)
            t += 1.0
        step = SLOT / adds  # the timed adds stay within one slot: the horizon does not move
        start = time.process_time()
        for i in range(adds):
            busy.add(t + i * step, t + i * step + 0.001)
        runs.append((time.process_time() - start) / adds * 1e6)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.live_entry", description=__doc__)
    parser.add_argument("--tapes", type=Path, required=True, help="captured tapes (bench.probes.relay_cpu --capture)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    finished = _finished(args.tapes, args.requests)
    if not finished:
        raise SystemExit(f"{args.tapes}: no finished request")
    print(
        json.dumps(
            {
                "requests": len(finished),
                "window_us_per_request": round(_window_us(finished, args.rounds), 2),
                "busy_add_us_full_horizon": round(_busy_us(args.rounds), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
