"""What reading records costs, one checkout against another: ``python -m bench.probes.readers_ab``.

Issue 44 made the readers skip and count damaged input and count each record once. This probe runs
``llmtap compare`` from two checkouts of llmtap (``--base``, ``--new``: each a tree with ``proxy/``), alternating
them round after round on the same data, so a busy machine weighs on both alike: a week of generated records
(``bench.probes.records_gen``) as Parquet and as gzip JSON lines, read by the engine and by plain Python, and the same
rows in a real ClickHouse (Debian's ``clickhouse-server``). The new checkout also reads the data with copies:
every 20th file again under another name (spread over every part of the engine), the last three files again
(what a journal's replay after a crash writes), and the table with 5% of its rows inserted again. It prints each
case's median wall and CPU time (the child's user + system) and whether every output said the same.

    python -m bench.probes.readers_ab --base /tmp/main --new . --work /tmp/ab --records 1000000 --lines 200000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PY = sys.executable


def child(tree: Path, argv: list[str]) -> tuple[float, float, str]:
    """``python -m llmtap ARGV`` from ``tree``: wall seconds, CPU seconds, standard output."""
    env = {**os.environ, "PYTHONPATH": f"{tree}/proxy:{tree}"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([PY, "-m", "llmtap", *argv], env=env, capture_output=True, text=True, cwd=tree)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, done.stdout


def data(new: Path, work: Path, records: int, lines: int) -> dict[str, Path]:
    """The generated folders, made once: as they are, with copies spread, and with a replay's copies."""
    env = {**os.environ, "PYTHONPATH": f"{new}/proxy:{new}"}
    out = {"parquet": work / "parquet", "jsonl": work / "jsonl"}
    if not out["parquet"].exists():
        gen = [PY, "-m", "bench.probes.records_gen"]
        subprocess.run([*gen, "-", str(records), "--parquet", str(out["parquet"])], check=True, cwd=new, env=env)
        subprocess.run([*gen, str(out["jsonl"]), str(lines)], check=True, cwd=new, env=env)
    for kind, pattern in (("parquet", "*.parquet"), ("jsonl", "*.jsonl.gz")):
        for how in ("spread", "replay"):
            dst = out[f"{kind} {how}"] = work / f"{kind}_{how}"
            if dst.exists():
                continue
            shutil.copytree(out[kind], dst)
            files = sorted(dst.rglob(pattern))
            for i, f in enumerate(files):
                if (how == "spread" and i % 20 == 0) or (how == "replay" and i >= len(files) - 3):
                    shutil.copy(f, f.with_name("replay-" + f.name))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.readers_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the checkout to compare against")
    p.add_argument("--new", type=Path, default=Path.cwd(), help="the checkout measured (this one)")
    p.add_argument("--work", type=Path, required=True, help="where the data and ClickHouse go (kept between runs)")
    p.add_argument("--records", type=int, default=1_000_000, help="records as Parquet and in ClickHouse")
    p.add_argument("--lines", type=int, default=200_000, help="records as gzip JSON lines")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    base, new = args.base.resolve(), args.new.resolve()
    sys.path[:0] = [str(new / "proxy"), str(new)]
    from bench.probes import clickhouse_scale
    from llmtap.store import clickhouse as ch
    from tests.support.clickhouse_server import ClickHouseProcess

    folders = data(new, args.work, args.records, args.lines)
    shutil.rmtree(args.work / "clickhouse", ignore_errors=True)
    server = ClickHouseProcess(args.work / "clickhouse")
    server.start(120)
    try:
        remote = ch.Server.parse(server.url)
        csv = args.work / "rows.csv"
        _, columns = clickhouse_scale.generate(csv, args.records)
        for name in ("once", "copies"):
            ch.create_table(remote, name, ttl_days=0)
            clickhouse_scale.load(remote, name, columns, csv)
        remote.query("INSERT INTO copies SELECT * FROM once WHERE cityHash64(trace_id) % 20 = 0")
        csv.unlink()
        cmd = ["compare", "--json", "--before", "v1", "--after", "v2"]
        table = ["--clickhouse", server.url, "--clickhouse-table"]
        cases: dict[str, list[tuple[str, Path, list[str]]]] = {}
        for name, kind, engine in (
            ("engine, parquet", "parquet", "duckdb"),
            ("engine, jsonl.gz", "jsonl", "duckdb"),
            ("python, jsonl.gz", "jsonl", "python"),
        ):
            cases[name] = [
                ("base", base, [*cmd, str(folders[kind]), "--engine", engine]),
                ("new", new, [*cmd, str(folders[kind]), "--engine", engine]),
                ("new, every 20th file twice", new, [*cmd, str(folders[f"{kind} spread"]), "--engine", engine]),
                ("new, a replay of 3 files", new, [*cmd, str(folders[f"{kind} replay"]), "--engine", engine]),
            ]
        cases["clickhouse"] = [
            ("base", base, [*cmd, *table, "once"]),
            ("new", new, [*cmd, *table, "once"]),
            ("new, 5% of rows twice", new, [*cmd, *table, "copies"]),
        ]
        times: dict[tuple[str, str], list[tuple[float, float]]] = {}
        outputs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.rounds):
            for name, runs in cases.items():
                for label, tree, argv_ in runs:
                    wall, cpu, out = child(tree, argv_)
                    times.setdefault((name, label), []).append((wall, cpu))
                    said = json.loads(out)
                    said.pop("source", None), said.pop("skipped", None)
                    outputs.setdefault(name, []).append(said)
        for name, runs in cases.items():
            parts = []
            for label, _, _ in runs:
                got = times[(name, label)]
                wall, cpu = statistics.median(w for w, _ in got), statistics.median(c for _, c in got)
                parts.append(f"{label}: wall {wall:.2f} s, CPU {cpu:.2f} s")
            same = all(o == outputs[name][0] for o in outputs[name])
            print(f"{name}: {'; '.join(parts)}; every output the same: {same}", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
