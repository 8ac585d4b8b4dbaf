"""``python -m bench.compare_scale``: ``llmtap compare`` and ``llmtap slo`` over millions of records.

Generates a week of records from six pods in the product's own format and dataset layout
(``bench.records_gen``: compressed JSON lines partitioned by date and hour, and the same rows as
Parquet), then runs ``llmtap compare DIR`` and ``llmtap slo DIR`` as child processes, each case alone,
and measures its wall time and its peak resident memory (the child's own ``ru_maxrss`` from ``wait4``):
the embedded engine over JSON lines and over Parquet at each size, the plain-Python path at the
smallest. The verdicts, figures and intervals of every case at one size must be equal (the source line
aside), or the run fails. ``--write`` puts the table into bench/RESULTS.md; the data is deleted after.

    python -m bench.compare_scale                       # 1M and 10M records (about 20 GB of disk at peak)
    python -m bench.compare_scale --sizes 20000 --python-sizes 20000   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.records_gen import PODS

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN, END = "<!-- compare_scale begin -->", "<!-- compare_scale end -->"


@dataclass
class Case:
    """One command over one dataset."""

    command: str
    records: int
    form: str
    engine: str
    seconds: float = 0.0
    rss_mb: float = 0.0
    output: dict[str, Any] | None = None


def run_child(argv: list[str]) -> tuple[float, float, str]:
    """Run ``argv``; its wall time, its peak RSS in MB (``wait4``) and its standard output."""
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode()
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return seconds, usage.ru_maxrss / 1024, text


def measure(case: Case, path: Path) -> Case:
    """Run one case and keep its figures."""
    argv = [sys.executable, "-m", "proxy", case.command, str(path), "--json", "--engine", case.engine]
    case.seconds, case.rss_mb, text = run_child(argv)
    data = json.loads(text)
    data.pop("source", None)
    case.output = data
    print(
        f"  {case.command:8} {case.records:>11,} {case.form:8} {case.engine:7}"
        f" {case.seconds:8.1f} s {case.rss_mb:8.0f} MB",
        flush=True,
    )
    return case


def du(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def replicate(base: Path, into: Path, copies: int) -> None:
    """``copies`` copies of the dataset ``base`` under ``into`` (hard links: no disk), as more pods would add."""
    for k in range(copies):
        for src in base.rglob("*"):
            if src.is_file():
                dst = into / f"copy{k}" / src.relative_to(base)
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.link(src, dst)


def run(sizes: list[int], python_sizes: list[int], work: Path, *, save: bool = False) -> tuple[list[Case], list[str]]:
    """Every case at every size; the notes of the datasets (generation time, bytes).

    The smallest size is generated; a larger one that is a multiple of it is that many copies of it
    (hard links), when generating it would take longer than the time the run has (it is said so)."""
    cases: list[Case] = []
    notes: list[str] = []
    smallest = min(sizes)
    base = work / f"n{smallest}"
    for n in sorted(sizes):
        data = work / f"n{n}"
        lines, parquet = data / "jsonl", data / "parquet"
        if n == smallest or n % smallest:
            started = time.perf_counter()
            # In a child: a child's peak RSS starts from its parent's at the fork, so the parent stays small.
            argv = [sys.executable, "-m", "bench.records_gen", str(lines), str(n), "--parquet", str(parquet)]
            subprocess.run(argv, check=True)
            made = time.perf_counter() - started
            how = f"generated in {made:.0f} s (JSON lines and Parquet)"
        else:
            replicate(base / "jsonl", lines, n // smallest)
            replicate(base / "parquet", parquet, n // smallest)
            how = f"{n // smallest} copies of the {smallest:,} records (hard links)"
        files = sum(1 for _ in lines.rglob("*.jsonl.gz"))
        notes.append(
            f"{n:,} records: {how}; {files} JSON-lines files from {PODS} pods, {du(lines) / 1e9:.2f} GB gzip"
            f" ({du(parquet) / 1e9:.2f} GB as Parquet, zstd)"
        )
        print(notes[-1], flush=True)
        at_size: list[Case] = []
        for command in ("compare", "slo"):
            at_size.append(measure(Case(command, n, "jsonl.gz", "duckdb"), lines))
            at_size.append(measure(Case(command, n, "parquet", "duckdb"), parquet))
            if n in python_sizes:
                at_size.append(measure(Case(command, n, "jsonl.gz", "python"), lines))
        for command in ("compare", "slo"):
            outputs = [c.output for c in at_size if c.command == command]
            if any(o != outputs[0] for o in outputs):
                raise SystemExit(f"{command} at {n:,} records: the outputs differ between the cases")
        cases += at_size
        if save:  # each size as it is done: a long run that stops still leaves what it measured
            write(table(cases, notes, machine()))
        if n != smallest:
            shutil.rmtree(data)
    shutil.rmtree(base, ignore_errors=True)
    return cases, notes


def machine() -> str:
    """The cores and how busy they were."""
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return f"{os.cpu_count()} cores ({platform.machine()}), shared with other work; load average {load} (1, 5, 15 min)"


def table(cases: list[Case], notes: list[str], cpus: str) -> str:
    """The section of RESULTS.md."""
    lines = [
        BEGIN,
        "## `llmtap compare` and `llmtap slo` at scale (`python -m bench.compare_scale`)",
        "",
        f"Machine: {cpus}. Records: a week of traffic from six pods in llmtap's record format (schema 2,",
        "about 1.5 KB a line, three routes, prompt version v1 then v2), in the dataset's layout",
        "`DIR/date=YYYY-MM-DD/hour=HH/<pod>-N.jsonl.gz`, and the same rows as Parquet. Each case is one",
        "child process, `llmtap compare DIR --json` (versions found, SLO verdicts of each side) or",
        "`llmtap slo DIR --json`, 2,000 resamples, run alone; wall time and its own peak RSS (`wait4`;",
        "the data is generated in another child, so the harness stays small: a child's peak starts from",
        "its parent's at the fork). A size that is a multiple of the smallest is copies of it (hard links).",
        "The outputs of every case at one size were equal (the source line aside); the run checks it.",
        "",
        *[f"- {note}" for note in notes],
        "",
        "| command | records | files | engine | wall time | peak RSS |",
        "| --- | ---: | --- | --- | ---: | ---: |",
    ]
    for c in cases:
        lines.append(
            f"| {c.command} | {c.records:,} | {c.form} | {c.engine} | {c.seconds:.1f} s | {c.rss_mb:,.0f} MB |"
        )
    lines += ["", END]
    return "\n".join(lines)


def write(section: str) -> None:
    """Put the section into RESULTS.md (replacing the last one)."""
    text = RESULTS.read_text(encoding="utf-8")
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    RESULTS.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (and write it with ``--write``)."""
    p = argparse.ArgumentParser(prog="python -m bench.compare_scale", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000], help="records per dataset")
    p.add_argument(
        "--python-sizes", type=int, nargs="*", default=[1_000_000], help="sizes the plain-Python path runs at too"
    )
    p.add_argument("--dir", type=Path, default=None, help="where the data goes (default: a temporary directory)")
    p.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="llmtap-scale-", dir=args.dir))
    try:
        cases, notes = run(args.sizes, args.python_sizes, work, save=args.write)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    section = table(cases, notes, machine())
    print(section)
    if args.write:
        write(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
