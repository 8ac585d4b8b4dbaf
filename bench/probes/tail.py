"""What holds the relay when a short request at a fixed rate is slow: ``python -m bench.probes.tail``.

The open loop at a fixed rate (``bench.openloop``) gives a p99, not its cause. This probe runs the same rig as the
requests-per-second part (the fixed 160-byte upstream and the generator on the client's core, ``llmtap serve``
from ``--tree`` with its whole tree on the proxy's core, ``--env NAME=VALUE`` for it; ``--direct`` adds a round
straight to the upstream, the client's floor; ``--alone`` rounds of the relay alone, its tapes dropped in process)
and, for each request, keeps its scheduled, sent and answered times on the monotonic clock. Around each round it
records, on the same clock:

* ``perf record`` of ``sched_switch``, ``sched_wakeup`` and ``sched_yield`` on both cores (root, or perf events
  allowed): who had each core, when the relay's event loop was woken and got the core, when the telemetry yielded;
* both processes' cyclic garbage collections (``gc.callbacks``, installed by a ``sitecustomize`` this probe puts on
  the tree's path; nothing in llmtap changes): when each began, how long it took, its generation; and with
  ``--env LLMTAP_PROBE_GAPS=PATH`` the telemetry's stretches of more than 0.4 ms of thread CPU between two looks at
  the relays (``sched.checkpoint``), with where each began and ended (``PATH.PID``).

Then: every wait of the relay for the core (woken until switched in) and who held the core meanwhile; those the
tree's own telemetry held alone (90% of the wait or more: no other process's load explains them), with how many
overlapped its collections and ended on its yield; and the slowest 1% of requests against the middle (p40-p60),
each window split by core and holder. ``--intake`` alone: the telemetry intake's longest stretch without a look
while it takes one gathered read of short requests' tapes. ``--worker-nice`` and ``--relay-slice-us`` try other
scheduling on a running tree. Prints one JSON line per round.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench import peers
from bench.rps import BODY, Rig, RpsPlan
from tests.support.net import free_port, wait_http
from tests.support.proctree import Service, pinned

#: What the relay's collector callback does (in the relay, through ``sitecustomize``): each collection's start,
#: length and generation, one line each, into ``$LLMTAP_PROBE_GC.PID``.
_SITECUSTOMIZE = """\
import gc, os, time
_path = os.environ.get("LLMTAP_PROBE_GC")
if _path:
    _fd, _began = os.open(f"{_path}.{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), [0.0]
    def _timed(phase, info):
        if phase == "start":
            _began[0] = time.perf_counter()
            return
        end = time.perf_counter()
        os.write(_fd, b"%.6f %.6f %d %d\\n" % (_began[0], end - _began[0], info["generation"], info["collected"]))
    gc.callbacks.append(_timed)
_gaps = os.environ.get("LLMTAP_PROBE_GAPS")
if _gaps:
    import builtins, sys, threading
    _real_import, _last = builtins.__import__, threading.local()

    def _patch(sched):
        look = sched.checkpoint

        def checkpoint():
            here, now = sys._getframe(1), time.thread_time()
            where = "%s:%d" % (here.f_code.co_filename.rsplit("llmtap/", 1)[-1], here.f_lineno)
            before = getattr(_last, "at", None)
            if before is not None and now - before[0] > 0.0004:
                with open(f"{_gaps}.{os.getpid()}", "a") as sink:
                    sink.write("%.6f %.3f %s %s\\n" % (time.perf_counter(), (now - before[0]) * 1e3, before[1], where))
            _last.at = (now, where)
            look()

        sched.checkpoint = checkpoint

    def _import(name, *args, **kwargs):
        module = _real_import(name, *args, **kwargs)
        sched = sys.modules.get("llmtap.telemetry.sched")
        if sched is not None and hasattr(sched, "checkpoint") and not getattr(sched, "_probed", False):
            sched._probed = True
            _patch(sched)
        return module

    builtins.__import__ = _import
"""
_WAKE = re.compile(r"\s(\d+\.\d+):\s+sched:sched_wakeup:.*?pid=(\d+) ")
_LINE = re.compile(r"\[(\d+)\]\s+(\d+\.\d+):\s+sched:sched_switch:.*?==> next_comm=(.*?) next_pid=(\d+)")


def switches(lines: Iterable[str]) -> dict[int, list[tuple[float, str, int]]]:
    """Each core's switches in time order: when, to which command and thread."""
    cores: dict[int, list[tuple[float, str, int]]] = collections.defaultdict(list)
    for line in lines:
        m = _LINE.search(line)
        if m:
            cores[int(m[1])].append((float(m[2]), m[3], int(m[4])))
    for events in cores.values():
        events.sort()
    return cores


_YIELD = re.compile(r"^\s*\S+\s+(\d+)\s+\[\d+\]\s+(\d+\.\d+):\s+syscalls:sys_enter_sched_yield")


def yields(lines: Iterable[str], tids: set[int]) -> list[float]:
    """When any of ``tids`` called ``sched_yield`` (the telemetry handing the core to a waiting relay), in order."""
    out = []
    for line in lines:
        m = _YIELD.search(line)
        if m and int(m[1]) in tids:
            out.append(float(m[2]))
    return sorted(out)


def wakeups(lines: Iterable[str], tid: int) -> list[float]:
    """When thread ``tid`` was woken, in time order."""
    out = []
    for line in lines:
        m = _WAKE.search(line)
        if m and int(m[2]) == tid:
            out.append(float(m[1]))
    return sorted(out)


def waits(
    events: Sequence[tuple[float, str, int]],
    woken: Sequence[float],
    tid: int,
    label: dict[int, str],
    collected: Sequence[tuple[float, float, int]],
    longer: float = 0.0005,
    yielded: Sequence[float] = (),
) -> dict[str, Any]:
    """Thread ``tid``'s waits for the core (woken until switched in) on one core's switches: their count and
    percentiles; for those over ``longer`` seconds, who held the core meanwhile; and the waits the telemetry
    process alone held (90% of the wait or more: what no other process's load explains), their lengths and how
    many of them a collection in ``collected`` (the telemetry's) overlapped."""
    ins = [e[0] for e in events if e[2] == tid]
    lengths: list[float] = []
    own: list[float] = []
    own_gc = 0
    own_yields = 0
    own_handed = 0
    who_ms: dict[str, float] = collections.defaultdict(float)
    for t in woken:
        k = bisect.bisect_left(ins, t)
        if k == len(ins):
            break
        wait = ins[k] - t
        lengths.append(wait)
        who = held(events, t, ins[k], label) if wait > 0.00005 else {}
        if wait > longer:
            for name, sec in who.items():
                who_ms[name] += sec * 1000
        if wait > 0.00005 and sum(v for n, v in who.items() if n.startswith("telemetry")) >= 0.9 * wait:
            own.append(wait)
            own_gc += any(c[0] < ins[k] and c[0] + c[1] > t for c in collected)
            if wait > longer:
                # The telemetry's yields while the relay waited: one within 20 µs of the relay's switch-in handed
                # it the core; one before that did not.
                ended = bisect.bisect_left(yielded, ins[k])
                handed = bisect.bisect_left(yielded, ins[k] - 20e-6)
                own_yields += handed - bisect.bisect_right(yielded, t)
                own_handed += ended > handed
    long_total = sum(w for w in lengths if w > longer)
    return {
        "wakeups": len(lengths), **_percentiles(lengths),
        "over_0.5ms": sum(w > longer for w in lengths), "over_0.5ms_total_ms": round(long_total * 1000, 2),
        "over_0.5ms_held_by_ms": {k: round(v, 2) for k, v in sorted(who_ms.items(), key=lambda kv: -kv[1])[:6]},
        "telemetry_held": {"count": len(own), **_percentiles(own), "total_ms": round(sum(own) * 1000, 2),
                           "over_0.5ms": sum(w > longer for w in own), "in_telemetry_gc": own_gc,
                           "over_0.5ms_ended_by_a_yield": own_handed,
                           "yields_that_did_not_hand_over": own_yields},
    }  # fmt: skip


def _percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 and max of ``values`` (seconds) in ms."""
    ordered = sorted(values)

    def pick(q: float) -> float | None:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3) if ordered else None

    return {"p50_ms": pick(0.5), "p90_ms": pick(0.9), "p99_ms": pick(0.99), "max_ms": pick(1.0)}


_TIMES: dict[int, list[float]] = {}


def held(events: Sequence[tuple[float, str, int]], start: float, end: float, label: dict[int, str]) -> dict[str, float]:
    """Seconds of ``[start, end]`` the core gave each label (by thread; ``idle``, else ``other``)."""
    out: dict[str, float] = collections.defaultdict(float)
    times = _TIMES.get(id(events))
    if times is None or len(times) != len(events):
        times = _TIMES[id(events)] = [e[0] for e in events]
    i = max(0, bisect.bisect_right(times, start) - 1)
    while i < len(events) and events[i][0] < end:
        t0 = max(start, events[i][0])
        t1 = min(end, events[i + 1][0]) if i + 1 < len(events) else end
        _, comm, tid = events[i]
        # Other processes by their command (other llmtap trees on the machine too: only this run's are labelled).
        name = "idle" if tid == 0 else label.get(tid, f"other:{comm}")
        if t1 > t0:
            out[name] += t1 - t0
        i += 1
    return out


def gcs(folder: Path, pids: Iterable[int]) -> list[tuple[float, float, int]]:
    """The relay's collections (start, seconds, generation), from each of ``pids`` that wrote some."""
    rows = []
    for path in (folder / f"gc.{pid}" for pid in pids):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            start, length, gen, _ = line.split()
            rows.append((float(start), float(length), int(gen)))
    return sorted(rows)


def _threads(pids: Iterable[int], name: str) -> dict[int, str]:
    """Each thread of ``pids`` labelled ``name``, a thread other than the main one by its own name too."""
    out = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            tid = int(task.name)
            out[tid] = name if tid == pid else f"{name}:{(task / 'comm').read_text().strip()}"
    return out


def analyse(
    times: list[list[float]],
    cores: dict[int, list[tuple[float, str, int]]],
    collected: dict[str, list[tuple[float, float, int]]],
    label: dict[int, str],
) -> dict[str, Any]:
    """The slowest 1% against the middle: their windows' shares by core and label (each other process by its
    command), and the share of them that each role's collections overlap; the collections by generation."""
    rows = sorted(times, key=lambda r: r[2] - r[0])
    n = len(rows)
    first, last = min(r[0] for r in rows), max(r[2] for r in rows)
    collected = {role: [c for c in got if first <= c[0] <= last] for role, got in collected.items()}
    groups = {"slowest_1pct": rows[int(n * 0.99) :], "middle": rows[int(n * 0.4) : int(n * 0.6)]}
    out: dict[str, Any] = {"requests": n}
    if cores:
        # Requests no other process touched (neither core gave another process any of their window): what this
        # run's own processes and the kernel make of the tail, whatever else the machine ran at other times.
        clean = [
            r
            for r in rows
            if not any(w.startswith("other") for e in cores.values() for w in held(e, r[0], r[2], label))
        ]
        m = len(clean)
        out["clean"] = {
            "count": m,
            **{f"latency_{k}": v for k, v in _percentiles([d - s for s, _, d in clean]).items()},
        }
        groups["clean_slowest_1pct"] = clean[int(m * 0.99) :]
    for name, group in groups.items():
        shares: dict[str, float] = collections.defaultdict(float)
        for scheduled, _sent, done in group:
            for core, events in cores.items():
                for who, sec in held(events, scheduled, done, label).items():
                    shares[f"cpu{core}_{who}_ms"] += sec * 1000
        big = {k: round(v / len(group), 3) for k, v in sorted(shares.items()) if v >= 0.05 * len(group)}
        out[name] = {
            "count": len(group),
            "latency_ms": statistics.median((d - s) * 1000 for s, _, d in group) if group else None,
            "late_ms": statistics.median((t - s) * 1000 for s, t, _ in group) if group else None,
            **{f"overlaps_{role}_gc": overlapping(group, got) for role, got in collected.items()},
            **big,
        }
    for role, got in collected.items():
        by_gen: dict[int, list[float]] = collections.defaultdict(list)
        for _, length, gen in got:
            by_gen[gen].append(length * 1000)
        out[f"{role}_gc"] = {
            str(g): {"count": len(v), "median_ms": statistics.median(v), "max_ms": max(v), "total_ms": sum(v)}
            for g, v in sorted(by_gen.items())
        }
    return out


def overlapping(group: Sequence[Sequence[float]], got: Sequence[tuple[float, float, int]]) -> float | None:
    """The share of the requests in ``group`` whose window a collection in ``got`` overlaps."""
    starts = [c[0] for c in got]
    hit = 0
    for scheduled, _sent, done in group:
        k = bisect.bisect_right(starts, done)
        hit += any(got[j][0] + got[j][1] > scheduled for j in range(max(0, k - 50), k))
    return hit / len(group) if group else None


def main(argv: list[str] | None = None) -> int:
    """Run the rounds under the tracers; print what each found."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.tail", description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, default=peers.REPO)
    p.add_argument("--rate", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--proxy-cpu", default="0")
    p.add_argument("--client-cpu", default="1")
    p.add_argument("--direct", action="store_true", help="a round straight to the upstream first: the client's floor")
    p.add_argument("--no-perf", action="store_true")
    p.add_argument("--worker-nice", type=int, help="renice the telemetry's threads but its main one by this much")
    p.add_argument("--relay-slice-us", type=int, help="set the relay's event-loop thread's scheduler slice")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for llmtap serve (repeatable)")
    p.add_argument("--alone", action="store_true", help="rounds of the relay alone too, its tapes dropped")
    p.add_argument("--serve-alone", type=int, metavar="UPSTREAM_PORT", help=argparse.SUPPRESS)
    p.add_argument(
        "--intake",
        action="store_true",
        help="only the telemetry's longest stretch without a look at the "
        "relays while it takes one gathered read of short requests' tapes (this process's llmtap)",
    )
    args = p.parse_args(argv)
    if args.intake:
        import uvloop

        print(json.dumps(_intake_stretch(uvloop.run(_tapes(1000)))))
        return 0
    if args.serve_alone:
        import uvloop

        uvloop.run(_serve_alone(args.serve_alone))
        return 0
    work = peers.REPO / "bench" / "out" / time.strftime("tail-%Y%m%d-%H%M%S")
    site = work / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    os.environ["LLMTAP_PROBE_GC"] = str(work / "gc")
    rig = Rig(work, RpsPlan(paths=()), args.proxy_cpu, args.client_cpu)
    tree = args.tree.resolve()
    try:
        port = rig.upstream()
        svc, url = _llmtap(rig, port, tree, site, dict(e.split("=", 1) for e in args.env))
        label = {**_threads(svc.roles()["relay"], "relay"), **_threads(svc.roles()["telemetry"], "telemetry")}
        label.update(_threads([rig.services[0].proc.pid], "upstream"))
        relays = {"llmtap": min(t for t, who in label.items() if who == "relay")}
        if args.worker_nice:
            for tid, who in label.items():
                if who.startswith("telemetry:"):
                    os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + args.worker_nice)
        if args.relay_slice_us:
            assert short_slice(args.relay_slice_us, relays["llmtap"])
        urls = {"llmtap": url}
        if args.alone:
            argv = [sys.executable, "-m", "bench.probes.tail", "--serve-alone", str(port)]
            env = {"PYTHONPATH": os.pathsep.join(map(str, (site, tree / "proxy", peers.REPO)))}
            alone = Service("relay-alone", argv, log=work / "relay-alone.log", cpu=args.proxy_cpu, env=env)
            rig.services.append(alone)
            urls["alone"] = f"http://127.0.0.1:{alone.read_line()}/v1/embeddings"
            relays["alone"] = alone.proc.pid
            label.update(_threads([alone.proc.pid], "relay"))
        for target in urls.values():
            rig.wrk(target, 16, 1.0)
        targets = [("direct", f"http://127.0.0.1:{port}/v1/embeddings")] if args.direct else []
        targets += [(name, urls[name]) for _ in range(args.rounds) for name in urls]
        for k, (name, target) in enumerate(targets):
            print(json.dumps(_round(work, k, name, target, args, label, relays.get(name))), flush=True)
    finally:
        rig.stop()
    return 0


def _llmtap(rig: Rig, upstream_port: int, tree: Path, site: Path, extra: dict[str, str]) -> tuple[Service, str]:
    """``llmtap serve`` from ``tree`` as ``Rig.llmtap`` starts it, with the collector's recorder on its path."""
    port, admin = free_port(), free_port()
    argv = [
        sys.executable, "-m", "llmtap", "serve", "--upstream", f"http://127.0.0.1:{upstream_port}",
        "--provider", "vllm", "--port", str(port), "--admin-port", str(admin), "--log-level", "warning",
    ]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join(map(str, (site, tree / "proxy", peers.REPO))), **extra}
    svc = Service("llmtap-tail", argv, log=rig.work / "llmtap-tail.log", cpu=rig.proxy_cpu, env=env)
    rig.services.append(svc)
    wait_http(f"http://127.0.0.1:{admin}/readyz", 60, alive=lambda: svc.proc.poll() is None)
    return svc, f"http://127.0.0.1:{port}/v1/embeddings"


def short_slice(microseconds: int, tid: int) -> bool:
    """Ask Linux (6.12 on, x86-64) for a scheduler slice of ``microseconds`` for thread ``tid``, its nice value
    and policy kept (``sched_setattr``'s runtime under SCHED_OTHER, ``SCHED_FLAG_KEEP_POLICY``)."""
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQ", 48, 0, 0x08, nice, 0, microseconds * 1000, 0, 0))
    return bool(libc.syscall(314, tid, attr, 0) == 0)


async def _tapes(count: int) -> list[Any]:
    """``count`` short requests' tapes as the relay hands them over (``create_app`` in process, the fixed answer)."""
    import asyncio
    import socket

    import uvicorn

    from bench.probes.short_exchange import _cpu_of, _Drop, _Upstream
    from llmtap.cli import parser
    from llmtap.config.load import build
    from llmtap.relay.app import create_app
    from llmtap.serve.server import uvicorn_config

    class Keep(_Drop):
        def __init__(self) -> None:
            self.got: list[Any] = []

        def send(self, message: Any, *, reserve: bool = False, shard: int = 0, at_once: bool = False) -> bool:
            self.got.append(message)
            return True

    loop = asyncio.get_running_loop()
    upstream = await loop.create_server(_Upstream, "127.0.0.1", 0)
    settings = build(
        vars(parser().parse_args(["serve", "--upstream", f"http://127.0.0.1:{upstream.sockets[0].getsockname()[1]}"]))
    )
    kept = Keep()
    server = uvicorn.Server(uvicorn_config(create_app(settings, channel=kept), settings))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 - uvicorn's flag
        await asyncio.sleep(0.01)
    await _cpu_of(sock.getsockname()[1], count)
    server.should_exit = True
    await serving
    upstream.close()
    return kept.got


def _intake_stretch(tapes: list[Any], reads: int = 30) -> dict[str, Any]:
    """The telemetry intake taking reads of 256 KiB of these tapes (as uvloop hands a gathered write over): the
    longest time between two looks at the relays (``sched.checkpoint``) in each read, and each read's whole time."""
    from llmtap.telemetry import process, sched
    from llmtap.wire.framing import FrameReader, encode_frames

    class Receiver:
        spool = None

        def submit_all(self, messages: Any, source: int = 0) -> None:
            pass

        def relay_ready(self, source: int, ready: bool) -> None:
            pass

    data = b"".join(b"".join(encode_frames(m)) for m in tapes * 2)[: 256 * 1024]
    looks: list[float] = []
    sched.checkpoint = lambda: looks.append(time.perf_counter())
    longest, whole = [], []
    for _ in range(reads):
        intake = process._Intake(Receiver(), 0, set())  # type: ignore[arg-type]
        looks.clear()
        began = time.perf_counter()
        intake.data_received(data)
        ended = time.perf_counter()
        marks = [began, *looks, ended]
        longest.append(max(b - a for a, b in itertools.pairwise(marks)))
        whole.append(ended - began)
    return {
        "read_bytes": len(data), "tapes_in_read": len(FrameReader().feed(data)),
        "longest_without_look_ms": _percentiles(longest), "read_ms": _percentiles(whole), "load": os.getloadavg()[0],
    }  # fmt: skip


async def _serve_alone(upstream_port: int) -> None:
    """The relay alone (``create_app`` under llmtap's server, default settings, collected and frozen after start-up
    as ``llmtap serve`` does), its tapes handed to a channel that drops them; prints its port."""
    import gc
    import socket

    from bench.probes.short_exchange import _Drop
    from llmtap.cli import parser
    from llmtap.config.load import build
    from llmtap.relay.app import create_app
    from llmtap.serve.server import Server, uvicorn_config

    settings = build(vars(parser().parse_args(["serve", "--upstream", f"http://127.0.0.1:{upstream_port}"])))
    server = Server(uvicorn_config(create_app(settings, channel=_Drop()), settings))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    gc.collect()
    gc.freeze()
    server.on_started = lambda: print(sock.getsockname()[1], flush=True)
    await server.serve(sockets=[sock])


def _round(
    work: Path, k: int, name: str, url: str, args: argparse.Namespace, label: dict[int, str], relay: int | None
) -> dict[str, Any]:
    """One open-loop run under the tracers."""
    trace, data = work / f"times-{k}.json", work / f"sched-{k}.data"
    perf = None
    if not args.no_perf and shutil.which("perf"):
        events = ("sched:sched_switch", "sched:sched_wakeup", "syscalls:sys_enter_sched_yield")
        argv = ["perf", "record", "-q", *(f"-e{e}" for e in events), "-a", "-k", "CLOCK_MONOTONIC", "-o", str(data)]
        perf = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    load = os.getloadavg()[0]
    argv = [
        sys.executable, "-m", "bench.openloop", "--url", url, "--rate", str(args.rate), "--seconds",
        str(args.seconds), "--body", BODY, "--trace", str(trace),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{peers.REPO}{os.pathsep}{peers.REPO / 'proxy'}"}
    env.pop("LLMTAP_PROBE_GC", None)
    done = subprocess.run(pinned(argv, args.client_cpu), capture_output=True, text=True, env=env, check=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    cores: dict[int, list[tuple[float, str, int]]] = {}
    if perf is not None:
        perf.send_signal(2)
        perf.wait(60)
        text = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True, text=True, check=True).stdout
        lines = text.splitlines()
        cores = switches(lines)
    label = {**label, summary["pid"]: "client"}
    collected = {
        role: gcs(work, [t for t, who in label.items() if who.split(":")[0] == role]) for role in ("relay", "telemetry")
    }
    got = analyse(json.loads(trace.read_text()), cores, collected, label)
    if cores and relay is not None:
        cpu = int(args.proxy_cpu.split(",")[0])
        mine = {t for t, who in label.items() if who.startswith("telemetry")}
        got["relay_waits"] = waits(
            cores[cpu], wakeups(lines, relay), relay, label, collected["telemetry"], yielded=yields(lines, mine)
        )
    return {"round": k, "path": name, "load": load, "latency_ms": summary["latency_ms"], **got}


if __name__ == "__main__":
    raise SystemExit(main())
