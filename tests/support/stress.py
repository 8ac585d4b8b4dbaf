"""Run the test suite while other processes keep every core busy: ``python -m tests.support.stress``.

The tests' timing bounds claim to hold on a busy machine; this is how that claim is checked. One busy
loop per core (``os.cpu_count()``, at normal priority, so they compete with the tests on equal terms) spins
for as long as the runs take, and the command runs ``--runs`` times in a row. Every run's exit status and
time are printed; the exit status is 0 only when every run passed.

    python -m tests.support.stress --runs 5                      # the README's pytest command, five times
    python -m tests.support.stress --runs 3 -- tests/e2e/test_e2e.py  # arguments after -- go to pytest instead

The busy loops stop when the runs end; should this process be killed (even with SIGKILL) they notice that
their parent is gone and stop within a fraction of a second, and in any case after ``--max-hours``. A
SIGTERM or SIGINT also stops the pytest run under way, as Ctrl-C would: its teardown runs.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def spin(deadline: float, parent: int) -> None:
    """Burn one core until the monotonic clock passes ``deadline`` or process ``parent`` is gone."""
    n = 0
    while time.monotonic() < deadline and os.getppid() == parent:
        for _ in range(100_000):
            n += 1


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_pytest(pytest_args: list[str]) -> int:
    """One pytest run in a session of its own; stopped as Ctrl-C would stop it, so its teardown runs.

    Interrupted (SIGTERM or SIGINT here), the whole session gets SIGINT, pytest's workers and the servers
    they started included, and a minute to finish its teardown; whatever is left then is killed.
    """
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            finally:
                os.killpg(proc.pid, signal.SIGKILL)
        raise


def main(argv: list[str] | None = None) -> int:
    """Start the busy loops, run pytest ``--runs`` times, stop the loops; 0 when every run passed."""
    parser = argparse.ArgumentParser(prog="python -m tests.support.stress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="how many runs in a row (default 5)")
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy loops (default: one per core)")
    parser.add_argument("--max-hours", type=float, default=3.0, help="the busy loops' own deadline (default 3)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: none, every test)")
    args = parser.parse_args(argv)

    context = multiprocessing.get_context("spawn")
    deadline = time.monotonic() + args.max_hours * 3600
    loops = [context.Process(target=spin, args=(deadline, os.getpid()), daemon=True) for _ in range(args.busy)]
    signal.signal(signal.SIGTERM, _stop)
    for loop in loops:
        loop.start()
    results: list[tuple[int, float]] = []
    try:
        for run in range(1, args.runs + 1):
            started = time.monotonic()
            print(f"== stress run {run}/{args.runs}: {args.busy} busy loops", flush=True)
            code = run_pytest(args.pytest_args)
            results.append((code, time.monotonic() - started))
            print(f"== stress run {run}/{args.runs}: exit {code} in {results[-1][1]:.0f} s", flush=True)
    finally:
        for loop in loops:
            loop.terminate()
        for loop in loops:
            loop.join(10)
    passed = sum(code == 0 for code, _ in results)
    print(f"== stress: {passed} of {len(results)} runs passed", flush=True)
    return 0 if passed == len(results) == args.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
