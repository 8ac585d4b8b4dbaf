"""Short requests through two checkouts of llmtap, side by side: ``python -m bench.probes.rps_ab``.

What a change to the per-request path bought, measured as the requests-per-second part measures it
(``bench.rps``): the fixed 160-byte upstream and ``wrk`` on the client's core, ``llmtap serve`` from each checkout
(``--base``, ``--new``: each a tree with ``proxy/``) with its whole tree on the proxy's core, both running
throughout. Rounds alternate the checkouts (base, new, base, new, ...), so a busy machine weighs on both alike;
each round is ``wrk`` at ``--connections`` for ``--seconds``, with each tree's CPU per request (relay and telemetry
apart, read until its telemetry drained). Prints one JSON line per round and one per checkout with the medians.
``--rate R``: each round is an open-loop run at R requests/s (``bench.openloop``, 64 connections) in place of
``wrk``: what the telemetry keeps up with at a fixed rate (``tapes_dropped`` and its share of the requests), and the
latency each checkout adds: every round first runs the same rate straight to the upstream (``direct``: the client's
floor), and each checkout's p50 and p99 less that round's direct ones are its ``added_p50_ms`` and ``added_p99_ms``.

    git archive HEAD~1 proxy | tar -x -C /tmp/base && python -m bench.probes.rps_ab --base /tmp/base --new .
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench import peers
from bench.rps import PATH, Rig, RpsPlan


def main(argv: list[str] | None = None) -> int:
    """Run the rounds; print each and the medians."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.rps_ab", description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--new", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--proxy-cpu", default="0")
    p.add_argument("--client-cpu", default="1")
    p.add_argument("--rate", type=int, help="open loop at this many requests/s in place of wrk's closed loop")
    args = p.parse_args(argv)
    work = peers.REPO / "bench" / "out" / time.strftime("rps-ab-%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    rig = Rig(work, RpsPlan(paths=()), args.proxy_cpu, args.client_cpu)
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    try:
        port = rig.upstream()
        for name, tree in trees.items():
            rig.keep(name, *rig.llmtap(port, tree, name=f"llmtap-{name}"))
        for name in trees:
            rig.wrk(rig.urls[name], args.connections, 1.0)
        direct_url = f"http://127.0.0.1:{port}{PATH}"
        for k in range(args.rounds):
            direct = None
            if args.rate:
                direct = _flat(rig.openloop(direct_url, args.rate, args.seconds))
                print(json.dumps({"tree": "direct", "round": k, "load": os.getloadavg()[0], **direct}), flush=True)
            for name in trees:
                if args.rate:
                    run = functools.partial(rig.openloop, rig.urls[name], args.rate, args.seconds)
                else:
                    run = functools.partial(rig.wrk, rig.urls[name], args.connections, args.seconds)
                row = _flat(rig.measured(name, run))
                row.update(tree=name, round=k, load=os.getloadavg()[0])
                if direct is not None:
                    row.update(
                        added_p50_ms=row["p50_ms"] - direct["p50_ms"], added_p99_ms=row["p99_ms"] - direct["p99_ms"]
                    )
                rows[name].append(row)
                print(json.dumps(row), flush=True)
    finally:
        rig.stop()
    for name, mine in rows.items():
        keys = ("requests_per_s", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms", "cpu_us_per_request",
                "cpu_relay_us_per_request", "cpu_telemetry_us_per_request", "tapes_dropped", "tapes_dropped_share",
                "load")  # fmt: skip
        medians = {
            k: statistics.median(r[k] for r in mine) for k in keys if mine and all(r.get(k) is not None for r in mine)
        }
        print(json.dumps({"tree": name, "path": str(trees[name]), "rounds": len(mine), "median": medians}))
    return 0


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    """A round's figures under the closed loop's names (an open-loop run's achieved rate and latency), with the
    share of its requests whose tapes the telemetry turned away."""
    if "achieved_rate" in row:
        row.update(requests=row["completed"], requests_per_s=row["achieved_rate"])
        row.update(p50_ms=row["latency_ms"]["p50"], p99_ms=row["latency_ms"]["p99"])
    done, dropped = row.get("requests") or 0, row.get("tapes_dropped")
    row["tapes_dropped_share"] = dropped / done if done and dropped is not None else None
    return row


if __name__ == "__main__":
    raise SystemExit(main())
