"""Who had the proxy's core while a burst started: ``python -m bench.probes.burst_windows --out DIR -- BENCH ARGS``.

A burst's TTFT p99 is the last of its requests: what the core did between the burst's release and that
request's first chunk decides it, and a percentile cannot say what that was. This probe runs ``python -m bench
BENCH ARGS --out DIR`` (bursts only are read) under ``perf record -e sched:sched_switch`` on the proxy's core, on
the monotonic clock the client and the upstream stamp their records with, and names every thread of the run's
own llmtap and nginx processes as it goes (``/proc``, and py-spy's thread names where py-spy is installed: the
telemetry's threads all share one command name). Then, for every burst of every path, two windows:

* **starts**: from the release to the last request's arrival at the upstream: accepting, parsing and
  forwarding the burst, on the proxy's side;
* **first chunks**: from the upstream's first first chunk to the client's last first chunk: each stream's
  answer head and first chunk relayed;

and how many milliseconds of the core each went to: the path's relay, its telemetry (by thread), any other
process (the machine's other work: on a shared machine, other engineers' processes), and idle. Beside them, per
path, the medians over bursts of each burst's slowest request taken apart: connect (the client's, on its own
core), until the upstream had it, and the first chunk's way back. ``--trace FILE`` reads a ``perf script`` output
already made instead (with ``--names FILE``, the names kept by a run). Needs root (or perf events allowed) and
``perf``.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SWITCH = re.compile(r"\s(\d+\.\d+):\s+sched:sched_switch:.*?==> next_comm=(.*?) next_pid=(\d+)")
_THREAD = re.compile(r'Thread (\d+) \(\w+\): "(.*)"')
#: The command names of llmtap's two processes (``/proc/PID/comm``), and nginx's (its whole tree is its relay).
RELAY, TELEMETRY, NGINX = "llmtap-relay", "llmtap-telemetr", "nginx"


@dataclass(frozen=True)
class Slice:
    """The core ran thread ``tid`` (command ``comm``) from ``start`` to ``end`` (monotonic seconds)."""

    start: float
    end: float
    comm: str
    tid: int


def slices(lines: Iterable[str]) -> list[Slice]:
    """The core's time, thread by thread, from ``perf script`` lines of ``sched_switch`` events."""
    events = []
    for line in lines:
        m = _SWITCH.search(line)
        if m:
            events.append((float(m.group(1)), m.group(2), int(m.group(3))))
    events.sort()
    return [Slice(t0, t1, comm, tid) for (t0, comm, tid), (t1, _, _) in itertools.pairwise(events)]


def spent(cut: Sequence[Slice], start: float, end: float, label: Mapping[int, str]) -> dict[str, float]:
    """Seconds of the core in ``[start, end)`` by label: ``label[tid]`` for the run's own threads, else the
    command's name (``swapper/N`` is idle)."""
    out: dict[str, float] = collections.defaultdict(float)
    for s in cut:
        if s.end <= start or s.start >= end:
            continue
        name = label.get(s.tid) or ("idle" if s.comm.startswith("swapper") else f"other:{s.comm}")
        out[name] += min(s.end, end) - max(s.start, start)
    return dict(sorted(out.items(), key=lambda item: -item[1]))


def bursts(doc: Mapping[str, Any]) -> dict[int, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """A burst records file's requests, client and upstream records joined, by burst."""
    upstream = {u["id"]: u for u in doc["upstream"]}
    out: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = collections.defaultdict(list)
    for rec in doc["client"]:
        up = upstream.get(rec["id"])
        if up is not None and rec.get("times") and up.get("sent"):
            out[rec["burst"]].append((rec, up))
    return dict(out)


def windows(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[tuple[float, float], tuple[float, float]]:
    """A burst's starts window and first-chunks window (see the module's docstring)."""
    release = min(r["release"] for r, _ in pairs)
    last_arrival = max(u["arrived"] for _, u in pairs)
    first_up = min(u["sent"][0] for _, u in pairs)
    last_client = max(r["times"][0] for r, _ in pairs)
    return (release, last_arrival), (first_up, last_client)


def slowest(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, float]:
    """The burst's request with the largest added TTFT, taken apart (ms): connect, to the upstream, back."""

    def added(pair: tuple[dict[str, Any], dict[str, Any]]) -> float:
        rec, up = pair
        return float((rec["times"][0] - rec["start"]) - (up["sent"][0] - up["arrived"]))

    rec, up = max(pairs, key=added)
    return {
        "added": 1e3 * added((rec, up)),
        "connect": 1e3 * (rec["sent"] - rec["start"]),
        "to_upstream": 1e3 * (up["arrived"] - rec["sent"]),
        "back": 1e3 * (rec["times"][0] - up["sent"][0]),
    }


def report(cut: Sequence[Slice], out: Path, label: Mapping[int, str]) -> list[dict[str, Any]]:
    """One row per path and burst: both windows' length and their core time by who had it (ms)."""
    rows: list[dict[str, Any]] = []
    if not cut:
        return rows
    lo, hi = cut[0].start, cut[-1].end
    for path in sorted(out.glob("records-burst-*.json")):
        for n, pairs in sorted(bursts(json.loads(path.read_text())).items()):
            starts, firsts = windows(pairs)
            if starts[0] < lo or firsts[1] > hi:
                continue
            row: dict[str, Any] = {"path": path.stem.removeprefix("records-burst-"), "burst": n, **slowest(pairs)}
            for name, (a, b) in (("starts", starts), ("first_chunks", firsts)):
                row[name] = {"ms": 1e3 * (b - a), **{k: 1e3 * v for k, v in spent(cut, a, b, label).items()}}
            rows.append(row)
    return rows


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return seen


def _names(root: int, label: dict[int, str], stop: threading.Event) -> None:
    """Label every thread of ``root``'s llmtap and nginx descendants (``relay:THREAD``, ``telemetry:THREAD``) until
    ``stop``."""
    spy = shutil.which("py-spy")
    while not stop.wait(2.0):
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                comm = (proc / "comm").read_text().strip()
            except OSError:
                continue
            if comm not in (RELAY, TELEMETRY, NGINX) or root not in _ancestors(int(proc.name)):
                continue
            kind = "telemetry" if comm == TELEMETRY else "relay"
            threads = {}
            if spy is not None:
                dump = subprocess.run(
                    [spy, "dump", "--pid", proc.name, "--nonblocking"], capture_output=True, text=True, check=False
                )
                threads = {int(m.group(1)): m.group(2) for m in map(_THREAD.match, dump.stdout.splitlines()) if m}
            for task in (proc / "task").glob("[0-9]*"):
                tid = int(task.name)
                label[tid] = f"{kind}:{threads.get(tid, label.get(tid, ':?').split(':', 1)[1])}"


def record(out: Path, cpu: str, bench_args: Sequence[str]) -> tuple[Path, dict[int, str]]:
    """Run the benchmark under ``perf`` on ``cpu``; the ``perf script`` text and the run's thread labels."""
    data, text = out / "sched.data", out / "sched.txt"
    out.mkdir(parents=True, exist_ok=True)
    perf = subprocess.Popen(
        ["perf", "record", "-q", "-e", "sched:sched_switch", "-C", cpu, "-k", "CLOCK_MONOTONIC", "-o", str(data)]
    )
    time.sleep(1.0)  # perf attached before the first burst
    label: dict[int, str] = {}
    stop = threading.Event()
    try:
        bench = subprocess.Popen([sys.executable, "-m", "bench", *bench_args, "--out", str(out)])
        namer = threading.Thread(target=_names, args=(bench.pid, label, stop), daemon=True)
        namer.start()
        bench.wait()
    finally:
        stop.set()
        perf.send_signal(2)
        perf.wait(60)
    with text.open("w") as sink:
        subprocess.run(["perf", "script", "-i", str(data)], stdout=sink, stderr=subprocess.DEVNULL, check=True)
    (out / "names.json").write_text(json.dumps(label))
    return text, label


def _median(values: Iterable[float]) -> float:
    return float(statistics.median(values))


def _window(got: Sequence[dict[str, Any]], name: str) -> str:
    """A window's median length, then the median core time of each holder: relay / telemetry / other / idle."""

    def held(prefix: str) -> float:
        return _median(sum(v for k, v in r[name].items() if k.startswith(prefix) and k != "ms") for r in got)

    parts = " / ".join(f"{held(who):.1f}" for who in ("relay", "telemetry", "other", "idle"))
    return f"{_median(r[name]['ms'] for r in got):.1f}: {parts}"


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Per path, medians over its bursts: the slowest request taken apart, and each window's core by holder."""
    by_path: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows:
        by_path[row["path"]].append(row)
    lines = [
        "| path | bursts | slowest request: added / connect / to upstream / back (ms) | starts window: ms, "
        "core to relay / telemetry / other / idle (ms) | first-chunks window: same |",
        "| --- | ---: | --- | --- | --- |",
    ]
    for path, got in by_path.items():
        slow = " / ".join(f"{_median(r[k] for r in got):.1f}" for k in ("added", "connect", "to_upstream", "back"))
        lines.append(f"| {path} | {len(got)} | {slow} | {_window(got, 'starts')} | {_window(got, 'first_chunks')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Record (or read) the trace and print one JSON line per burst, then the table."""
    args = list(sys.argv[1:] if argv is None else argv)
    bench_args = args[args.index("--") + 1 :] if "--" in args else []
    own = args[: args.index("--")] if "--" in args else args
    p = argparse.ArgumentParser(prog="python -m bench.probes.burst_windows", description=__doc__)
    p.add_argument("--out", required=True, help="the benchmark's results folder")
    p.add_argument("--cpu", default="0", help="the proxy's core (bench's --proxy-cpu)")
    p.add_argument("--trace", help="read this perf script output instead of running the benchmark")
    p.add_argument("--names", help="with --trace: the thread labels a run kept (names.json)")
    opts = p.parse_args(own)
    out = Path(opts.out).resolve()
    if opts.trace:
        text = Path(opts.trace)
        label = {int(k): v for k, v in json.loads(Path(opts.names).read_text()).items()} if opts.names else {}
    else:
        text, label = record(out, opts.cpu, bench_args)
    with text.open() as lines:
        rows = report(slices(lines), out, label)
    for row in rows:
        print(json.dumps(row))
    print(markdown(rows))


if __name__ == "__main__":
    main()
