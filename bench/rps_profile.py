"""Where a short request's CPU goes, in both of llmtap's processes: a sampled profile under the rps load.

``python -m bench --rps-only --rps-profile SECONDS``: llmtap's whole
tree on the proxy's core, as the rps part runs it, under ``wrk`` at 16 keep-alive connections; ``py-spy`` (found on
``PATH`` or at ``$BENCH_PY_SPY``; ``pip install py-spy``) samples the relay and the telemetry process for
``SECONDS`` without stopping them (``--nonblocking``), and ``/proc`` gives each process's CPU over the same window.
Each sample is put in the stage of the innermost frame a rule names (``RELAY_STAGES``, ``TELEMETRY_STAGES``: the
listener's parse, Starlette's routing, admission, request inspection, the upstream exchange, the answer, the tape,
the hand-over; the telemetry's intake, replay, summary, emitters), and each stage's share of the samples times the
process's CPU per request is that stage's µs per request. The top functions by their own samples are given the same
way.

The telemetry process is moved to the client's core for the profile, so the relay has its core to itself. A
sampler counts a thread that waits for the core as running: a thread woken from ``epoll`` waits with the event
loop as its innermost frame, so the process's run-queue wait over the window (``/proc/PID/task/*/schedstat``) is
taken off the event loop's samples; the telemetry's ``sched_yield`` to a waiting relay (``checkpoint``) is taken
out and said apart; idle threads (in ``epoll`` or on a queue) are not sampled. The µs come from ``/proc``'s CPU
over the same window, the shares from the samples.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import peers
from bench.procs import quiesce
from bench.rps import Rig, RpsPlan
from tests.support.proctree import pin_threads, pinned

LOOP = "event loop (uvloop, C: reads, callbacks)"
#: (stage, substrings of a frame): a sample's stage is the first rule matched by its innermost matching frame.
RELAY_STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hand-over (tape to the telemetry channel)", ("relay/handover.py", "relay/gauges.py", "relay/channel.py",
                                                   "wire/socketchannel.py", "wire/framing.py", "wire/messages.py")),
    ("tape", ("wire/tape.py",)),
    ("answer out to the client (uvicorn send, or head and body at once)", ("RequestResponseCycle.send",
                                                                           "relay/oneshot.py")),
    ("answer body relay (pipe)", ("relay/pipe.py", "relay/strip.py")),
    ("answer head", ("response_headers", "relay/heads.py", "relay/answers.py", "relay/breaks.py")),
    ("upstream exchange", ("relay/upstream/", "relay/tls.py")),
    ("admission and in-flight counts", ("relay/admission.py", "relay/shared.py", "Exchange._admit")),
    ("request inspection (guard, body, provider, upstream request)", (
        "providers/", "relay/guard.py", "relay/bodyread.py", "relay/fingerprint.py", "wire/tracecontext.py",
        "wire/tracestate.py", "relay/forward.py", "relay/timing.py")),
    ("request handler (relay/app.py's and the exchange's own)", (
        "relay/app.py", "relay/exchange.py", "relay/lifecycle.py", "relay/watch.py")),
    ("Starlette routing and middleware", ("starlette/", "uvicorn/middleware", "relay/frame.py")),
    ("listener parse (uvicorn, httptools)", ("httptools_impl.py", "llmtap/listener.py", "uvicorn/")),
    (LOOP, ("asyncio/runners.py", "uvloop/")),
)  # fmt: skip
YIELDED = "yielded to the relay (sched_yield)"
# Each stage by the files of its code: the telemetry side's rooms (``telemetry/emit/``, ...) and, for a checkout from
# before them, the files' former places.
TELEMETRY_STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (YIELDED, ("checkpoint (llmtap/telemetry/sched.py)",)),
    ("metrics (emitter and SDK)", ("telemetry/emit/metrics.py", "telemetry/emit/instruments.py",
                                   "telemetry/emit/bulk.py",
                                   "telemetry/metrics.py", "telemetry/instruments.py", "telemetry/bulk.py",
                                   "metrics/_internal", "opentelemetry/metrics", "exemplar")),
    ("spans (emitter and SDK)", ("telemetry/emit/spans.py", "telemetry/emit/otlp_spans.py",
                                 "telemetry/emit/chunkdetail.py",
                                 "telemetry/spans.py", "telemetry/otlp_spans.py", "telemetry/chunkdetail.py",
                                 "sdk/trace", "trace/__init__.py", "trace/span.py", "attributes/__init__.py")),
    ("records, access log, live view", ("telemetry/emit/finished.py", "telemetry/records/", "telemetry/admin/access",
                                        "telemetry/admin/live/",
                                        "telemetry/finished.py", "telemetry/records.py", "telemetry/access",
                                        "telemetry/live/", "telemetry/dataset.py", "telemetry/recordlogs.py")),
    ("summary (analysis)", ("llmtap/analysis/summary.py", "analysis/finish.py", "analysis/estimator.py",
                            "analysis/cachediag.py", "analysis/fingerprint.py", "analysis/tokens.py",
                            "analysis/attribution.py", "tiktoken")),
    ("replay (tape to timeline)", ("telemetry/intake/replay.py", "telemetry/intake/streams.py",
                                   "telemetry/intake/tap.py",
                                   "telemetry/replay.py", "telemetry/streams.py", "telemetry/tap.py",
                                   "providers/", "analysis/timeline.py")),
    ("losses and relay counts", ("telemetry/journal/losses.py", "telemetry/intake/relays.py",
                                 "telemetry/losses.py", "telemetry/relays.py")),
    ("intake (frames from the relay)", ("telemetry/process.py", "wire/framing.py", "wire/messages.py")),
    # The recorder's inbox, worker thread, emission batch and counters were the recorder's own before the rooms.
    ("recorder dispatch", ("telemetry/recorder.py", "telemetry/intake/inbox.py", "telemetry/loop.py",
                           "telemetry/emit/batch.py", "telemetry/counts.py", "llmtap/worker.py")),
    (LOOP, ("asyncio/runners.py", "uvloop/")),
)  # fmt: skip
OTHER = "other"
_LINE = re.compile(r":\d+\)$")


Rules = Sequence[tuple[str, tuple[str, ...]]]


def stacks(text: str) -> Counter[tuple[str, ...]]:
    """py-spy's ``raw`` (collapsed) output: each stack, root first, frames without line numbers, and its count."""
    out: Counter[tuple[str, ...]] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            out[tuple(_LINE.sub(")", f) for f in stack.split(";"))] += int(count)
    return out


def stage_of(stack: Sequence[str], rules: Rules) -> str:
    """The stage of the innermost frame that a rule names (``OTHER`` when none does)."""
    for frame in reversed(stack):
        for stage, marks in rules:
            if any(m in frame for m in marks):
                return stage
    return OTHER


def breakdown(
    samples: Counter[tuple[str, ...]], rules: Rules, us_per_request: float, *, waiting: float = 0.0, top: int = 15
) -> dict[str, Any]:
    """Stages and the top functions by own samples, each as a share and as µs per request.

    ``YIELDED`` samples are counted apart and out of the shares. ``waiting`` is the share of the sampled time the
    process spent runnable but waiting for a core (``run_queue_wait`` against its CPU): a thread woken from
    ``epoll`` waits there with the event loop as its innermost frame, so that many samples (less those yielded)
    come off the event loop's stage and its own frame before the shares are taken.
    """
    by_stage: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for stack, n in samples.items():
        stage = stage_of(stack, rules)
        by_stage[stage] += n
        if stage != YIELDED:
            own[stack[-1]] += n
    yielded = by_stage.pop(YIELDED, 0)
    queued = max(0, round(waiting * (sum(by_stage.values()) + yielded)) - yielded)
    loop_frame = next((f for f, _ in own.most_common() if "asyncio/runners.py" in f), None)
    if queued and loop_frame is not None:
        queued = min(queued, by_stage[LOOP], own[loop_frame])
        by_stage[LOOP] -= queued
        own[loop_frame] -= queued
    else:
        queued = 0
    working = sum(by_stage.values())

    def row(name: str, n: int) -> dict[str, Any]:
        share = n / working if working else 0.0
        return {"name": name, "samples": n, "share": share, "us_per_request": share * us_per_request}

    return {
        "samples": working,
        "yielded_samples": yielded,
        "queued_samples": queued,
        "us_per_request": us_per_request,
        "stages": [row(s, n) for s, n in by_stage.most_common()],
        "top": [row(f, n) for f, n in own.most_common(top)],
    }


def run_queue_wait(pid: int) -> float:
    """Seconds the threads of ``pid`` have waited, runnable, for a core (``/proc/PID/task/*/schedstat``)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def py_spy() -> str:
    """The py-spy to run."""
    found = os.environ.get("BENCH_PY_SPY") or shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy not found: pip install py-spy (or set BENCH_PY_SPY)")
    return found


def run(work: Path, plan: RpsPlan, proxy_cpu: str | None, client_cpu: str | None, seconds: float) -> dict[str, Any]:
    """Profile llmtap's two processes for ``seconds`` under 16 connections; each one's breakdown."""
    spy = py_spy()
    rig = Rig(work, replace(plan, paths=("llmtap",)), proxy_cpu, client_cpu)
    try:
        rig.start()
        svc = rig.trees["llmtap"]
        url = rig.urls["llmtap"]
        rig.wrk(url, 16, plan.warm)
        quiesce(svc, settle=plan.settle)
        roles = svc.roles()
        pids = {"relay": roles["relay"][0], "telemetry": roles["telemetry"][0]}
        if client_cpu is not None:
            # The relay alone on its core: no wait for the core behind its own telemetry in its samples.
            pin_threads(pids["telemetry"], {int(c) for c in client_cpu.split(",")})
        length = seconds + 3.0
        load = subprocess.Popen(
            pinned(["wrk", "-t1", "-c16", f"-d{round(length)}s", "-s", str(work / "rps.lua"), url], client_cpu),
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        admin = rig.admins["llmtap"]
        dropped0 = peers.scrape_sum(admin) or 0.0
        cpu0 = svc.cpu_roles()
        waits0 = {role: run_queue_wait(pid) for role, pid in pids.items()}
        t0 = time.perf_counter()
        spies = {role: _spy(spy, pid, seconds, work / f"profile-{role}.txt", client_cpu) for role, pid in pids.items()}
        for proc in spies.values():
            proc.wait(timeout=seconds + 60)
        window = time.perf_counter() - t0
        cpu1 = svc.cpu_roles()
        dropped = (peers.scrape_sum(admin) or 0.0) - dropped0
        waits = {role: run_queue_wait(pid) - waits0[role] for role, pid in pids.items()}
        out, _ = load.communicate(timeout=length + 60)
    finally:
        rig.stop()
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT ") :])
    rate = got["requests"] / (got["duration_us"] / 1e6)
    requests = rate * window
    result: dict[str, Any] = {"seconds": window, "requests_per_s": rate, "load": os.getloadavg().__repr__()}
    for role, rules in (("relay", RELAY_STAGES), ("telemetry", TELEMETRY_STAGES)):
        us = 1e6 * (cpu1[role] - cpu0[role]) / requests if requests else 0.0
        text = (work / f"profile-{role}.txt").read_text() if (work / f"profile-{role}.txt").exists() else ""
        cpu = cpu1[role] - cpu0[role]
        result[role] = breakdown(stacks(text), rules, us, waiting=waits[role] / (cpu + waits[role]) if cpu > 0 else 0)
        result[role]["run_queue_wait_s"] = waits[role]
    # The telemetry's CPU over the tapes it recorded, not over the requests relayed: the tapes it turned away cost it
    # next to nothing, so per request relayed it looks cheaper the more it drops.
    recorded = max(requests - dropped, 0.0)
    result["tapes_dropped"] = dropped
    result["telemetry"]["us_per_tape"] = 1e6 * (cpu1["telemetry"] - cpu0["telemetry"]) / recorded if recorded else None
    return result


def _spy(spy: str, pid: int, seconds: float, out: Path, cpu: str | None) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` 250 times a second for ``seconds`` without stopping it, into ``out`` (collapsed)."""
    argv = [spy, "record", "--pid", str(pid), "--duration", str(round(seconds)), "--rate", "250", "--nonblocking"]
    argv += ["--format", "raw", "-o", str(out)]
    return subprocess.Popen(pinned(argv, cpu), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def markdown(profile: dict[str, Any]) -> str:
    """The profile's tables: stages and top functions of each process, in µs per request."""
    lines = [
        f"Profile: {profile['requests_per_s']:,.0f} requests/s at 16 connections over {profile['seconds']:.1f} s "
        f"(load {profile['load']}).",
    ]
    for role in ("relay", "telemetry"):
        p = profile[role]
        per_tape = p.get("us_per_tape")
        lines += [
            "",
            f"{role}: {p['us_per_request']:.0f} µs of CPU per request"
            + (
                f", {per_tape:.0f} per tape recorded ({profile['tapes_dropped']:,.0f} of the window's tapes dropped)"
                if per_tape is not None
                else ""
            )
            + f" ({p['samples']} samples"
            + (f"; {p['yielded_samples']} more yielded to the relay, left out" if p["yielded_samples"] else "")
            + f"; {p['queued_samples']} of the loop's waiting for the core, left out"
            + ")",
            "",
            "| stage | share | µs per request |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {r['name']} | {100 * r['share']:.1f}% | {r['us_per_request']:.1f} |" for r in p["stages"]]
        lines += ["", "| function (own samples) | share | µs per request |", "| --- | --- | --- |"]
        lines += [f"| `{r['name']}` | {100 * r['share']:.1f}% | {r['us_per_request']:.1f} |" for r in p["top"]]
    return "\n".join(lines)
