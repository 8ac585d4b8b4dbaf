"""``python -m bench.probes.scale``: ``llmtap compare`` and ``llmtap slo`` at 1M and 10M records, every source, one run.

Per size, a week of traffic from six pods is generated in llmtap's record format and dataset layout
(``bench.probes.records_gen``: one file per pod and UTC hour, ``DIR/date=YYYY-MM-DD/hour=HH/pod<k>-0.parquet``,
zstd, about a thousand files a week; at the sizes the plain-Python path runs at, the same rows as
gzip JSON lines too), and the same rows are loaded into a real ClickHouse (Debian's ``clickhouse-server``,
started on free ports as the tests start it). Then each case runs as a child process, alone:

* the embedded engine (``--engine duckdb``) over the Parquet files, at every size, ``--repeats`` times;
* the embedded engine over the gzip JSON lines and the plain-Python path (``--engine python``) over them,
  at ``--python-sizes``, once;
* ``--clickhouse`` over the table, at every size, ``--repeats`` times.

The commands: ``compare`` (before and after the prompt version changed), ``compare --split-at`` (before and
after a moment, six hours each side) and ``slo``.

Each case's wall time (the median of its repeats, and the range), its CPU time (user + system, the
child's own), its peak RSS (the child's own ``VmHWM``, read as it exits) and, for ClickHouse, the
server's peak RSS while the case ran (sampled every 50 ms) are kept. The outputs of every case at one
size must be equal (what names the source aside): the run fails loudly when they are not. ``--write``
puts the table into bench/RESULTS.md; the data and the server's directory are deleted after.

    python -m bench.probes.scale                                             # 1M and 10M records
    python -m bench.probes.scale --sizes 20000 --python-sizes 20000 --repeats 1   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.probes.records_gen import PODS, SWITCH

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parents[1] / "RESULTS.md"
BEGIN, END = "<!-- scale begin -->", "<!-- scale end -->"
#: What a case may take at most (a child past it is killed and the run fails).
CASE_TIMEOUT = 1200.0
#: The targets the issue names for 10M records on the embedded engine.
TARGET_S, TARGET_MB = 30.0, 1536.0
#: Output keys that name where the records came from, not what they say.
SOURCE_KEYS = ("source",)
#: Lines of a file not read as records: ClickHouse holds no lines, so it says null where files say 0.
FILE_ONLY_KEYS = ("skipped",)
#: The commands, each by its name in the table and the arguments it takes after the source.
COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("compare", ()),
    (
        "compare --split-at",
        ("--split-at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(SWITCH)), "--window", "6h"),
    ),
    ("slo", ()),
)

_PEAK = """
import atexit, sys
def peak():
    with open("/proc/self/status") as f:
        sys.stderr.write("".join(line for line in f if line.startswith("VmHWM:")))
atexit.register(peak)
from llmtap.cli import main
sys.exit(main(sys.argv[1:]))
"""


@dataclass
class Case:
    """One command over one source at one size, with its repeats' figures."""

    command: str
    records: int
    source: str  # 'engine, parquet' / 'engine, jsonl.gz' / 'python, jsonl.gz' / 'clickhouse'
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    rss_mb: float = 0.0
    server_mb: float | None = None
    output: dict[str, Any] | None = None

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpus)


def _vm_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_child(argv: list[str], *, watch: int | None = None) -> tuple[float, float, float, float | None, str]:
    """``python -m llmtap ARGV``: wall time, CPU time, peak RSS (MB), the watched process's peak RSS while it ran
    (MB, or None), and its standard output. Exit 0 or 1 (a verdict) is a result; anything else fails the run."""
    peak_server = [0.0]
    done = threading.Event()

    def sample() -> None:
        assert watch is not None
        while not done.is_set():
            peak_server[0] = max(peak_server[0], _vm_rss_mb(watch))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True) if watch is not None else None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if sampler is not None:
            sampler.start()
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", _PEAK, *argv], stdout=out, stderr=err, env=env, cwd=ROOT)
        deadline = started + CASE_TIMEOUT
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                proc.wait()
                raise SystemExit(f"{' '.join(argv)}: no answer within {CASE_TIMEOUT:.0f} s")
            time.sleep(0.02)
        wall = time.perf_counter() - started
        done.set()
        if sampler is not None:
            sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text, errors = out.read().decode(), err.read().decode(errors="replace")
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {errors[-2000:]}")
    peaks = [line for line in errors.splitlines() if line.startswith("VmHWM:")]
    rss = int(peaks[-1].split()[1]) / 1024
    return wall, usage.ru_utime + usage.ru_stime, rss, (peak_server[0] if watch is not None else None), text


def measure(case: Case, argv: list[str], repeats: int, *, watch: int | None = None) -> Case:
    """Run one case ``repeats`` times; its outputs must not differ between the repeats."""
    for _ in range(repeats):
        wall, cpu, rss, server, text = run_child(argv, watch=watch)
        data = json.loads(text)
        for key in SOURCE_KEYS:
            data.pop(key, None)
        if case.output is not None and data != case.output:
            raise SystemExit(f"{case.command} on {case.source} at {case.records:,}: two repeats differ")
        case.output = data
        case.walls.append(wall)
        case.cpus.append(cpu)
        case.rss_mb = max(case.rss_mb, rss)
        if server is not None:
            case.server_mb = max(case.server_mb or 0.0, server)
    server_text = f", ClickHouse server {case.server_mb:,.0f} MB" if case.server_mb is not None else ""
    print(
        f"  {case.command:18} {case.records:>11,} {case.source:18} {case.wall:7.1f} s"
        f" ({', '.join(f'{w:.1f}' for w in case.walls)}) cpu {case.cpu:6.1f} s {case.rss_mb:7.0f} MB{server_text}",
        flush=True,
    )
    return case


def du(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def first_difference(a: Any, b: Any, where: str = "") -> str:
    """Where two outputs first differ (for the failure message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{where}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return first_difference(x, y, f"{where}[{i}]")
    return f"{where or '(top)'}: {json.dumps(a)[:300]} against {json.dumps(b)[:300]}"


def comparable(case: Case) -> dict[str, Any]:
    """A case's output as the others' must equal it."""
    out = dict(case.output or {})
    if case.source == "clickhouse":
        for key in FILE_ONLY_KEYS:
            out.pop(key, None)
    return out


def run(args: argparse.Namespace, work: Path) -> tuple[list[Case], list[str]]:
    """Every case at every size; notes on the datasets."""
    from bench.probes import clickhouse_scale
    from llmtap.store import clickhouse as ch
    from tests.support.clickhouse_server import ClickHouseProcess, installed

    cases: list[Case] = []
    notes: list[str] = []
    server: ClickHouseProcess | None = None
    if not args.no_clickhouse:
        if not installed():
            raise SystemExit(
                "clickhouse-server is not installed (.ci/install.d/35-clickhouse.sh); --no-clickhouse to leave it out"
            )
        server = ClickHouseProcess(work / "clickhouse")
        server.start(120)
    try:
        release = ".".join(str(v) for v in ch.Server.parse(server.url).version()[:2]) if server else ""
        for n in sorted(args.sizes):
            data = work / f"n{n}"
            parquet, lines = data / "parquet", data / "jsonl"
            with_lines = n in args.python_sizes
            started = time.perf_counter()
            # In a child: the generator's engine stays out of this process.
            gen = [sys.executable, "-m", "bench.probes.records_gen", str(lines) if with_lines else "-", str(n)]
            subprocess.run([*gen, "--parquet", str(parquet)], check=True, cwd=ROOT)
            made = time.perf_counter() - started
            files = sum(1 for _ in parquet.rglob("*.parquet"))
            note = (
                f"{n:,} records: {files} Parquet files from {PODS} pods (one per pod and hour),"
                f" {du(parquet) / 1e9:.2f} GB"
            )
            if with_lines:
                count = sum(1 for _ in lines.rglob("*.jsonl.gz"))
                note += f"; the same rows as {count} gzip JSON-lines files, {du(lines) / 1e9:.2f} GB"
            note += f"; generated in {made:.0f} s"
            table = f"records_{n}"
            if server is not None:
                remote = ch.Server.parse(server.url)
                ch.create_table(remote, table, ttl_days=0)
                csv = data / "rows.csv"
                gen_s, columns = clickhouse_scale.generate(csv, n)
                load_s = clickhouse_scale.load(remote, table, columns, csv)
                csv.unlink()
                count = int(server.query(f"SELECT count() FROM {table}").strip())
                if count != n:
                    raise SystemExit(f"ClickHouse holds {count:,} rows of {n:,}")
                note += (
                    f"; loaded into ClickHouse {release} in {load_s:.0f} s ({n / load_s:,.0f} rows/s;"
                    f" its CSV made in {gen_s:.0f} s)"
                )
            notes.append(note)
            print(note, flush=True)
            at_size: list[Case] = []
            for command, extra in COMMANDS:
                base = [command.split()[0], "--json", *extra]
                at_size.append(
                    measure(
                        Case(command, n, "engine, parquet"),
                        [*base[:1], str(parquet), *base[1:], "--engine", "duckdb"],
                        args.repeats,
                    )
                )
                if with_lines:
                    at_size.append(
                        measure(
                            Case(command, n, "engine, jsonl.gz"),
                            [*base[:1], str(lines), *base[1:], "--engine", "duckdb"],
                            1,
                        )
                    )
                    at_size.append(
                        measure(
                            Case(command, n, "python, jsonl.gz"),
                            [*base[:1], str(lines), *base[1:], "--engine", "python"],
                            1,
                        )
                    )
                if server is not None:
                    assert server.proc is not None
                    argv = [*base, "--clickhouse", server.url, "--clickhouse-table", table]
                    case = Case(command, n, "clickhouse")
                    at_size.append(measure(case, argv, args.clickhouse_repeats, watch=server.proc.pid))
            for command, _ in COMMANDS:
                mine = [c for c in at_size if c.command == command]
                for other in mine[1:]:
                    a, b = comparable(mine[0]), comparable(other)
                    if other.source == "clickhouse":
                        for key in FILE_ONLY_KEYS:
                            a.pop(key, None)
                    if a != b:
                        where = first_difference(a, b)
                        raise SystemExit(
                            f"{command} at {n:,} records: {other.source} differs from {mine[0].source} at {where}"
                        )
            print(f"  outputs equal at {n:,} records: {'; '.join(sorted({c.source for c in at_size}))}", flush=True)
            cases += at_size
            if server is not None:
                server.query(f"DROP TABLE {table}")
            shutil.rmtree(data)
    finally:
        if server is not None:
            server.stop()
    return cases, notes


def machine() -> str:
    """The cores and how busy they were."""
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return f"{os.cpu_count()} cores ({platform.machine()}), load average {load} (1, 5, 15 min) at the end"


def verdict_line(case: Case) -> str:
    """What the outputs said, in a few words."""
    out = case.output or {}
    if case.command.startswith("compare"):
        said = out.get("verdict") or out.get("versions") or ""
        return json.dumps(said)[:200]
    kinds = sorted({str(v.get("verdict")) for v in out.get("verdicts", []) if isinstance(v, dict)})
    return ", ".join(kinds)


def section(cases: list[Case], notes: list[str], cpus: str, args: argparse.Namespace, shared: str) -> str:
    """The section of RESULTS.md."""
    sizes = sorted({c.records for c in cases})
    lines = [
        BEGIN,
        "## `llmtap compare` and `llmtap slo` at 1M and 10M records, every source (`python -m bench.probes.scale`)",
        "",
        f"Machine: {cpus}; {shared}. One run, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "Records: a week of traffic from six pods in llmtap's record format (schema 2, three routes, prompt",
        "version v1 then v2), one file per pod and UTC hour as each pod's writer rotates them",
        "(`bench.probes.records_gen`), and the same rows loaded into ClickHouse. Each case is a child process,",
        "`llmtap compare SOURCE --json` (by prompt version, and `--split-at` the change with six hours each",
        "side) or `llmtap slo SOURCE --json` (2,000 resamples), run alone: wall",
        f"time (median of {args.repeats} runs for the engine over Parquet, of {args.clickhouse_repeats} for"
        " ClickHouse,",
        "the range in brackets; one run of the others), CPU time (user + system, the child's own: what the",
        "case cost apart from the load of the machine), peak RSS of the analysing process (its own",
        "`VmHWM`), and the ClickHouse server's peak RSS while the case ran (sampled every 50 ms; the server is",
        "not the analysing process). The outputs of every case at one size were equal, all of it but the line",
        "naming the source (and, for ClickHouse, the counts of file lines not read as records, which it has",
        "none of); the run fails when they are not.",
        "",
        *[f"- {note}" for note in notes],
        "",
        "| command | records | source | wall time | CPU time | peak RSS | ClickHouse server RSS |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for c in cases:
        spread = f" ({min(c.walls):.1f}-{max(c.walls):.1f})" if len(c.walls) > 1 else ""
        server = f"{c.server_mb:,.0f} MB" if c.server_mb is not None else ""
        lines.append(
            f"| {c.command} | {c.records:,} | {c.source} | {c.wall:.1f} s{spread} | {c.cpu:.1f} s"
            f" | {c.rss_mb:,.0f} MB | {server} |"
        )
    lines += ["", "Ratios in this run (wall time; CPU time in brackets):", ""]
    by = {(c.command, c.records, c.source): c for c in cases}
    small, large = sizes[0], sizes[-1]
    for command, _ in COMMANDS:
        engine_small = by.get((command, small, "engine, parquet"))
        engine_large = by.get((command, large, "engine, parquet"))
        parts: list[str] = []

        def ratio(a: Case | None, b: Case | None, label: str, parts: list[str] = parts) -> None:
            if a is not None and b is not None and b.wall > 0 and b.cpu > 0:
                parts.append(f"{label} {a.wall / b.wall:.1f}x ({a.cpu / b.cpu:.1f}x)")

        if large != small:
            ratio(engine_large, engine_small, f"engine {large:,} / {small:,}:")
        ratio(by.get((command, small, "python, jsonl.gz")), engine_small, f"python / engine at {small:,}:")
        ratio(
            by.get((command, small, "engine, jsonl.gz")),
            engine_small,
            f"engine gzip JSON lines / Parquet at {small:,}:",
        )
        for n in sizes:
            ratio(
                by.get((command, n, "clickhouse")),
                by.get((command, n, "engine, parquet")),
                f"ClickHouse / engine at {n:,}:",
            )
        lines.append(f"- {command}: " + "; ".join(parts))
    lines.append("")
    for command, _ in COMMANDS:
        for n in sizes:
            engine = by.get((command, n, "engine, parquet"))
            if engine is not None:
                lines.append(f"- {command} at {n:,}, every source said: {verdict_line(engine)}")
    target = [by.get((cmd, large, "engine, parquet")) for cmd in ("compare", "slo")]
    if large >= 10_000_000 and all(target):
        met = all(c.wall < TARGET_S and c.rss_mb < TARGET_MB for c in target if c)
        lines += [
            "",
            f"Target for {large:,} records on the engine (under {TARGET_S:.0f} s and {TARGET_MB / 1024:.1f} GB RSS):"
            f" {'met' if met else 'NOT met'} in this run.",
        ]
    lines += ["", END]
    return "\n".join(lines)


def write(text: str) -> None:
    """Put the section into RESULTS.md (replacing the last one)."""
    old = RESULTS.read_text(encoding="utf-8")
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        old = head + text + tail
    else:
        old = old.rstrip("\n") + "\n\n" + text + "\n"
    RESULTS.write_text(old, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the section (and write it with ``--write``)."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.scale", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000], help="records per dataset")
    p.add_argument(
        "--python-sizes", type=int, nargs="*", default=[1_000_000], help="sizes the plain-Python path runs at"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of the engine's and ClickHouse's cases (the median)")
    p.add_argument("--clickhouse-repeats", type=int, default=3, help="runs of ClickHouse's cases (the median)")
    p.add_argument("--no-clickhouse", action="store_true", help="leave ClickHouse out (said in the output)")
    p.add_argument("--shared", default="shared with other work", help="how busy the machine was, in words")
    p.add_argument("--dir", type=Path, default=None, help="where the data goes (default: a temporary directory)")
    p.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    args = p.parse_args(argv)
    # A run stopped from outside still stops its ClickHouse and deletes its data (the finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.path.insert(0, str(ROOT))
    work = Path(tempfile.mkdtemp(prefix="llmtap-scale-", dir=args.dir))
    try:
        cases, notes = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.no_clickhouse:
        notes.append("ClickHouse left out of this run (--no-clickhouse)")
    text = section(cases, notes, machine(), args, args.shared)
    print(text)
    if args.write:
        write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
