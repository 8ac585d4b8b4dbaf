"""What a newcomer reads: ``llmtap simulate --help`` and ``llmtap demo``'s tables, verdicts and progress.

Everything runs through the real command line (``python -m llmtap ...`` in a child process), piped as in a
CI log, or with stderr on a pseudo-terminal as in a shell.
"""

from __future__ import annotations

import argparse
import os
import pty
import re
import subprocess
import sys
import tty
from pathlib import Path

import pytest

from llmtap.cli import parser
from llmtap.commands.demo import FIXED_FIRST, VARIABLE_FIRST, default_workloads
from llmtap.simulator import PROFILES

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def llmtap(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    if "PYTHONPATH" in os.environ:  # the package of the checkout under test, where it is not the one installed
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run(
        [sys.executable, "-m", "llmtap", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


def subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[name]
    return found


def flat(text: str) -> str:
    """Text with every run of whitespace made one space: help wraps lines where the terminal ends."""
    return " ".join(text.split())


# ---------------------------------------------------------------- llmtap simulate --help


def test_simulate_help_gives_every_option_its_text_and_default_and_the_profiles() -> None:
    out = llmtap("simulate", "--help")
    assert out.returncode == 0, out.stderr
    text = flat(out.stdout)
    options = [a for a in subcommand("simulate")._actions if a.option_strings]
    assert {o for a in options for o in a.option_strings} >= {"--host", "--port", "--profile", "--list-profiles"}
    for action in options:
        assert action.help, action.option_strings
        assert all(o in text for o in action.option_strings)
        shown = flat(action.help) + ("" if action.default is argparse.SUPPRESS else f" (default: {action.default})")
        assert shown in text, (action.option_strings, shown)
    for profile in PROFILES.values():
        assert f"{profile.name} {profile.about}" in text, profile.name
        assert f"decode {profile.decode_s_per_token * 1000:g} ms/token" in text, profile.name
        assert f"{profile.max_num_seqs} slots" in text, profile.name
    listed = llmtap("simulate", "--list-profiles")
    assert listed.returncode == 0 and listed.stderr == ""
    assert flat(listed.stdout) in text  # the same table, and only the table
    assert flat(listed.stdout).startswith("profiles (--profile NAME): support the course's support assistant")
    unknown = llmtap("simulate", "--profile", "nope", timeout=60)
    known = ", ".join(sorted(PROFILES))
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines()[-1] == f"llmtap: error: unknown profile 'nope'; known: {known}"


def test_demo_help_states_the_defaults_it_runs_with() -> None:
    text = flat(llmtap("demo", "--help", timeout=60).stdout)
    support, code = default_workloads()
    assert f"(default {support.requests} support, {code.requests} code)" in text
    assert f"(default {support.output_tokens} support, {code.output_tokens} code)" in text
    assert support.slo.ttft is not None and code.slo.ttft is not None
    assert f"(default {support.slo.ttft * 1000:g} support, {code.slo.ttft * 1000:g} code)" in text
    assert support.slo.tpot is not None and code.slo.tpot is not None
    assert f"(default {support.slo.tpot * 1000:g} support, {code.slo.tpot * 1000:g} code)" in text
    gain = "--min-gain-ms MIN_GAIN_MS least TTFT p50 gain the verdict counts, ms, besides a tenth of the before p50 (0)"
    assert gain in text


# ---------------------------------------------------------------- llmtap demo, piped


def cells(line: str) -> list[str]:
    """A table line's cells: columns are two spaces or more apart, a cell has single spaces at most."""
    return re.split(r"\s{2,}", line.strip())


def table(out: str, workload: str) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """The group header, the statistics header and the rows by layout of one workload's table."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{workload}: "))
    groups, stats, rule = lines[at + 1], lines[at + 2], lines[at + 3]
    assert set(rule.strip()) <= {"-", " "}
    rows = {cells(line)[0]: cells(line) for line in lines[at + 4 : at + 6]}
    return cells(groups), cells(stats), rows


def per_request_objectives(out: str) -> dict[tuple[str, str], tuple[int, int]]:
    """The demo's per-request objective table: (met, violated) by layout and objective, the header checked."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Per-request objectives (x-slo-ttft-ms"))
    at = next(i for i in range(at, len(lines)) if lines[i].startswith("  route"))
    assert cells(lines[at]) == ["route", "layout", "objective", "met", "violated"], lines[at]
    assert set(lines[at + 1].strip()) <= {"-", " "}
    found: dict[tuple[str, str], tuple[int, int]] = {}
    for line in lines[at + 2 :]:
        if not line.strip():
            break
        route, layout, objective, met, violated = cells(line)
        assert route == "support", line
        found[(layout, objective)] = (int(met), int(violated))
    return found


def test_demo_tables_name_every_statistic_and_both_token_rates() -> None:
    # --min-gain-ms above the support assistant's ~650 ms gain: a real gain that the threshold turns down.
    args = ("--workload", "support", "--requests", "4", "--output-tokens", "40", "--min-gain-ms", "1000")
    out = llmtap("demo", *args)
    assert out.returncode == 0, out.stderr
    groups, stats, rows = table(out.stdout, "support assistant")
    assert groups == ["TTFT", "ITL", "TPOT", "output tokens/s", "goodput", "queue", "prefill", "decode", "cached"]
    assert stats == [
        "layout",
        "p50",
        "p95",
        "p50",
        "p95",
        "p50",
        "per stream p50",
        "all streams",
        "req/s (met SLO)",
        "p50",
        "p50",
        "p50",
        "share",
    ]
    assert set(rows) == {VARIABLE_FIRST, FIXED_FIRST}
    for layout, row in rows.items():
        assert len(row) == len(stats), row
        per_stream, all_streams = float(row[6]), float(row[7])
        # The course's ~45 tokens/s a stream: 22 ms a token, a little slower with four in the batch.
        assert 30 <= per_stream <= 1 / 0.022 + 1, (layout, row)
        assert row[5].endswith(" ms") and 1000 / float(row[5].split()[0]) == pytest.approx(per_stream, rel=0.1)
        if layout == FIXED_FIRST:
            # Four streams at once, prefill short: the total is several times one stream's rate.
            assert all_streams > 2 * per_stream, row
    verdict = next(line for line in out.stdout.splitlines() if line.startswith("support assistant: no significant"))
    found = re.search(r"\(([+-]\d+\.\d+%), CI ([+-]\d+\.\d+%) to ([+-]\d+\.\d+%)\): a real (\d+) ms gain", verdict)
    assert found, verdict
    value, low, high = (float(x.rstrip("%")) for x in found.groups()[:3])
    assert low <= value <= high < 0 and low != high, verdict
    assert 300 < int(found.group(4)) < 1000 and "below the 1000 ms threshold (--min-gain-ms)" in verdict
    assert "--route support" in out.stdout  # the compare command it suggests is for the workload that ran
    # Every other request asks for its own tight TTFT, the rest for loose limits: counts by layout and limit that
    # no load changes (the uncached prompt's prefill alone is ~780 ms, past 300 ms; no answer nears a minute).
    objectives = per_request_objectives(out.stdout)
    for layout in (VARIABLE_FIRST, FIXED_FIRST):
        tight = objectives[(layout, "TTFT <= 300 ms")]
        assert sum(tight) == 2, objectives
        assert objectives[(layout, "TTFT <= 60.00 s")] == objectives[(layout, "TPOT <= 1.00 s")] == (2, 0)
    assert objectives[(VARIABLE_FIRST, "TTFT <= 300 ms")] == (0, 2)
    assert len(objectives) == 6, objectives
    # Piped: a line as each phase starts and one as it ends, not one a request.
    progress = out.stderr.splitlines()
    assert "\r" not in out.stderr and len(progress) == 1 + 2 * 2, out.stderr
    assert progress[0] == "llmtap demo: a simulated LLM server, the proxy in front of it, support assistant (offline)."
    assert progress[1] == f"support assistant, {VARIABLE_FIRST}: 4 requests at concurrency 4, after one warm-up"
    assert re.fullmatch(rf"support assistant, {FIXED_FIRST}: 4/4 done in \d+\.\d s", progress[4]), progress


# ---------------------------------------------------------------- llmtap demo, on a terminal


def test_demo_progress_on_a_terminal_moves_from_the_first_request_on() -> None:
    master, slave = pty.openpty()
    tty.setraw(slave)  # no newline translation: the bytes as the demo wrote them
    args = ["--workload", "support", "--requests", "2", "--concurrency", "2", "--output-tokens", "40"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmtap", "demo", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": os.environ.get("TMPDIR", "/tmp")},
    )
    os.close(slave)
    seen = b""
    try:
        while True:
            try:
                piece = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not piece:
                break
            seen += piece
    finally:
        os.close(master)
        stdout, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, seen.decode()
    assert b"support assistant" in stdout
    text = seen.decode()
    updates = [u.rstrip("\n") for line in text.split("\n") for u in line.split("\r\033[K") if u]
    cold = [u for u in updates if u.startswith(f"support assistant, {VARIABLE_FIRST}: ")]
    states = [u.split(": ", 1)[1] for u in cold]
    assert states[0] == "warm-up request, 0 s", states
    # Each request's start shows before any request ends (the old progress counted finished ones only).
    first_done = next(i for i, s in enumerate(states) if re.search(r", [1-9]\d* done", s))
    # The warm-up may tick on a busy machine before the first request starts.
    waiting = [s for s in states[1:first_done] if not s.startswith("warm-up request, ")]
    assert waiting and waiting[0].startswith("1/2 started, 0 done"), states
    # Waiting on the first token and the decode (~1.7 s), the line still moves every second: the start of
    # the second request, then at least one tick before the first answer ends.
    assert len([s for s in waiting if s.startswith("2/2 started, 0 done")]) >= 2, states
    # On a terminal, each phase ends on a line of its own, the running line replaced by the result.
    visible = [line.rsplit("\r\033[K", 1)[-1] for line in text.split("\n") if line]
    assert visible[0].startswith("llmtap demo: ")
    assert [re.sub(r"\d+\.\d s$", "T", v) for v in visible[1:]] == [
        f"support assistant, {VARIABLE_FIRST}: 2/2 done in T",
        f"support assistant, {FIXED_FIRST}: 2/2 done in T",
    ], visible
