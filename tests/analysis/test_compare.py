"""``llmtap compare``: the bootstrap, the verdicts, bad input, and the course's two workloads on the simulator.

The simulator checks run the real commands in their own processes (``llmtap simulate``, ``llmtap serve
--record``, ``llmtap compare``), so the timings are the simulator's and the proxy's, not a shared GIL's.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap import cli
from llmtap.analysis.compare import Side, analyze
from llmtap.analysis.stats import Distribution, quantile, quantile_estimate
from llmtap.simulator.text import Vocabulary
from llmtap.store.files import ReadStats, read_records
from llmtap.telemetry.records.record import SCHEMA_KEY
from tests.conftest import PATIENCE, free_port, require_real
from tests.support.procs import stop
from tests.telemetry.test_prometheus import histogram_quantile

ROOT = Path(__file__).parents[2]


def within(value: float | None, target: float, share: float = 0.10, slack: float = 0.0) -> bool:
    return value is not None and abs(value - target) <= share * target + slack


# -- the bootstrap ---------------------------------------------------------------------------------


def test_quantiles_of_samples_and_of_histogram_buckets() -> None:
    # Samples: linear between the closest ranks, as numpy and aiperf read them.
    dist = Distribution([5.0, 1.0, 4.0, 2.0, 3.0])
    assert [dist.quantile(q) for q in (0.2, 0.5, 0.8, 0.99)] == pytest.approx([1.8, 3.0, 4.2, 4.96])
    assert Distribution().quantile(0.5) is None
    # Buckets read as Prometheus' histogram_quantile reads them: linear inside the bucket.
    series = [(0.1, 2.0), (0.2, 10.0), (0.4, 30.0), (0.8, 31.0), (math.inf, 32.0)]
    hist = Distribution(buckets=series)
    assert hist.n == 32
    for q in (0.05, 0.5, 0.9, 0.97, 0.999):
        assert hist.quantile(q) == pytest.approx(histogram_quantile(q, series)), q


def test_the_two_draw_bootstrap_equals_resampling() -> None:
    rng = random.Random(7)
    sample = [rng.lognormvariate(-1.0, 0.6) for _ in range(60)]
    ordered = sorted(sample)
    dist = Distribution(sample)
    for q in (0.5, 0.95, 1.0):  # at q = 1, a whole rank: one draw, nothing to interpolate
        exact = quantile_estimate(dist, q, random.Random(1), 4000)
        assert exact is not None
        brute = sorted(quantile([rng.choice(sample) for _ in sample], q) or 0.0 for _ in range(4000))
        lo, hi = brute[int(0.025 * 3999)], brute[math.ceil(0.975 * 3999)]
        # The same interval, up to one rank of the sample at either end.
        assert abs(bisect.bisect(ordered, exact.low) - bisect.bisect(ordered, lo)) <= 1, (q, exact, lo)
        assert abs(bisect.bisect(ordered, exact.high) - bisect.bisect(ordered, hi)) <= 1, (q, exact, hi)
    again = quantile_estimate(dist, 0.5, random.Random(1), 4000)
    assert again == quantile_estimate(dist, 0.5, random.Random(1), 4000)


def side(label: str, ttfts: list[float], cached: float = 0.0) -> Side:
    s = Side(label, requests=len(ttfts), ttft=Distribution(ttfts), prefill=Distribution(ttfts))
    s.input_tokens, s.cached_tokens = 1000 * len(ttfts), round(1000 * len(ttfts) * cached)
    return s


def spread(center: float, n: int = 20, width: float = 0.02, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [center * (1 + rng.uniform(-width, width)) for _ in range(n)]


@pytest.mark.parametrize(
    ("before", "after", "kind", "start"),
    [
        (side("v1", spread(0.78)), side("v2", spread(0.12), cached=0.85), "gain", "caching gain: TTFT p50 7"),
        (side("v1", spread(0.78)), side("v2", spread(0.30)), "gain", "TTFT gain, not from caching"),
        # Issue 30: a 25 ms route's real 11 ms gain is a gain (the least that counts is a tenth of the before p50).
        (side("v1", spread(0.025)), side("v2", spread(0.014), 0.56), "gain", "caching gain: TTFT p50 25 ms to 14 ms"),
        (side("v1", spread(0.78)), side("v2", spread(0.755), 0.56), "no_gain", "no significant gain: TTFT p50 78"),
        (side("v1", spread(0.5, width=0.5)), side("v2", spread(0.5, width=0.5, seed=1)), "", "no significant"),
        (side("v1", spread(0.12)), side("v2", spread(0.78)), "regression", "regression: TTFT p50 1"),
        (side("v1", spread(0.78, n=2)), side("v2", spread(0.12)), "insufficient", "no verdict: too few requests"),
    ],
)
def test_verdicts(before: Side, after: Side, kind: str, start: str) -> None:
    c = analyze(before, after, source="test", split="test")
    assert c.verdict.startswith(start), c.verdict
    assert c.kind == kind or (not kind and c.kind in ("no_gain", "no_change") and "includes no change" in c.verdict)
    assert "\n" not in c.verdict
    if kind == "gain":
        change = c.change["ttft_p50"]
        assert change is not None and change["relative"].high < 0 < -change["seconds"].value
    if kind == "no_gain":
        # Real (the interval excludes zero) but small: the verdict names the threshold and what set it.
        assert "): a real 2" in c.verdict and " ms gain, but below the 78 ms threshold" in c.verdict, c.verdict
        assert "(10% of the before p50, --min-gain-share)" in c.verdict


def test_the_least_gain_that_counts_is_relative_or_set_by_the_user() -> None:
    before, after = side("v1", spread(0.031)), side("v2", spread(0.021), 0.5)
    # Issue 30: "a real 10 ms gain, but below the 100 ms threshold" was the verdict of a 31 ms route.
    assert analyze(before, after, source="t", split="t").kind == "gain"
    c = analyze(before, after, source="t", split="t", min_gain_ms=100)
    assert c.kind == "no_gain" and "a real 10 ms gain, but below the 100 ms threshold (--min-gain-ms)" in c.verdict
    c = analyze(before, after, source="t", split="t", min_gain_share=0.5)
    assert c.kind == "no_gain" and "below the 16 ms threshold (50% of the before p50, --min-gain-share)" in c.verdict
    assert c.min_gain == pytest.approx(0.5 * c.before.ttft["p50"].value)  # type: ignore[union-attr]
    # A rise is held to the same bar: a real 1 ms rise of a 31 ms route is no regression.
    c = analyze(before, side("v2", spread(0.032, seed=5)), source="t", split="t")
    assert c.kind == "no_change" and "a real 1" in c.verdict and "rise, but below the 3.1 ms threshold" in c.verdict


# -- record files and the command ------------------------------------------------------------------


def record(version: str, ttft: float, *, at: str = "2026-05-01T12:00:00.000+00:00", cached: int = 0) -> dict[str, Any]:
    return {
        SCHEMA_KEY: 1,
        "time": at,
        "route": "support",
        "model": "m",
        "stream": True,
        "outcome": "ok",
        "prompt_version": version,
        "ttft": ttft,
        "prefill": ttft - 0.001,
        "prefill_source": "upstream_ttft",
        "tokens": {"input": 6200, "cache_read": cached},
        "cache": {"class": "hit" if cached else "miss_changed"},
    }


def write(path: Path, recs: list[dict[str, Any]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + tail)
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def gain_records() -> list[dict[str, Any]]:
    before = [record("v1", t, at=f"2026-05-01T12:00:{i:02d}Z") for i, t in enumerate(spread(0.78, 12))]
    after = [record("v2", t, at=f"2026-05-01T13:00:{i:02d}Z", cached=5248) for i, t in enumerate(spread(0.12, 12))]
    return before + after


def test_bad_lines_are_counted_and_the_report_still_made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.jsonl"
    write(path, gain_records())
    with path.open("a") as f:
        f.write('{"msg": "a line of some other log"}\n')
        f.write("garbage\n")
        f.write(json.dumps(record("v1", 0.5) | {SCHEMA_KEY: 99}) + "\n")
        f.write('{"llmtap_record":1,"time":"2026-05-01T13:')  # the last line, cut short
    code, out, err = run(["compare", str(path), "--before", "v1", "--after", "v2"], capsys)
    assert code == 0, err
    assert "skipped: 1 truncated, 2 foreign, 1 other schema" in out
    assert err.splitlines() == [  # one line per cause on stderr, with the file
        f"llmtap: skipped 1 line cut short in 1 file: {path} (1)",
        f"llmtap: skipped 2 lines that are not records in 1 file: {path} (2)",
        f"llmtap: skipped 1 line of a record schema version this llmtap does not read in 1 file: {path} (1)",
    ]
    assert out.strip().splitlines()[-1].startswith("caching gain: TTFT p50 7")
    assert "cache classes  miss_changed 12" in out and "hit 12" in out
    code, out, _ = run(["compare", str(path), "--before", "v1", "--after", "v2", "--json"], capsys)
    data = json.loads(out)
    assert data["skipped"] == {"truncated": 1, "foreign": 2, "other_schema": 1}
    assert data["kind"] == "gain" and data["before"]["requests"] == data["after"]["requests"] == 12
    assert within(data["before"]["ttft"]["p50"]["value"], 0.78, 0.03)
    assert data["after"]["cached_share"] == pytest.approx(5248 / 6200)


def test_ways_to_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "r.jsonl", gain_records())
    code, out, _ = run(["compare", str(path), "--json"], capsys)  # two versions: in order of appearance
    assert code == 0 and json.loads(out)["split"] == "prompt version v1 against v2"
    code, out, _ = run(["compare", str(path), "--split-at", "2026-05-01T12:30:00Z", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["kind"] == "gain" and data["before"]["requests"] == 12
    code, out, _ = run(
        ["compare", str(path), "--split-at", "2026-05-01T12:30:00Z", "--window", "45m", "--json"], capsys
    )
    assert json.loads(out)["after"]["requests"] == 12
    code, out, _ = run(["compare", str(path), "--before", "v2", "--after", "v1"], capsys)
    assert out.strip().splitlines()[-1].startswith("regression")
    write(tmp_path / "three.jsonl", [*gain_records(), record("v3", 0.2)])
    for argv, message in [
        (["compare", str(tmp_path / "three.jsonl")], "versions seen: v1, v3, v2"),
        (["compare", str(path), "--before", "v1"], "--before and --after go together"),
        (["compare", str(path), "--before", "v1", "--after", "v2", "--split-at", "2026-05-01"], "not both"),
        (["compare", str(tmp_path / "missing.jsonl"), "--before", "a", "--after", "b"], "no record file"),
        (["compare", str(path), "--split-at", "yesterday"], "not an ISO 8601 time"),
        (["compare", str(path), "--window", "soon"], "not a duration"),
        (["compare"], "a record file or --prometheus"),
    ]:
        code, _, err = run(argv, capsys)
        assert code == 2 and message in err and err.count("\n") == 1, (argv, err)


def test_too_few_requests_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "r.jsonl", [record("v1", 0.78), record("v2", 0.12), record("v2", 0.13)])
    code, out, _ = run(["compare", str(path), "--before", "v1", "--after", "v2"], capsys)
    assert code == 0
    assert out.strip().splitlines()[-1].startswith("no verdict: too few requests with a TTFT (1 before, 2 after")


# -- like with like, a relative least gain, unknown versions, the slowest requests by trace id ---


def shaped(version: str, ttft: float, t: float, shape: str, trace: int) -> dict[str, Any]:
    from datetime import UTC, datetime

    at = datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
    # Six decimals, as the proxy writes them (ClickHouse keeps no more).
    extra = {SCHEMA_KEY: 2, "shape": shape, "trace_id": f"{trace:032x}", "prefill": round(ttft - 0.001, 6)}
    return record(version, ttft, at=at) | extra


T0 = 1777636800.0  # 2026-05-01T12:00:00Z


def mix_records(seed: int = 30) -> list[dict[str, Any]]:
    """Issue 30's case: v1, 24 short prompts (about 14 ms); v2, half an hour later, 12 short and 24 long ones
    (about 120 ms). Nothing got slower, yet a pooled p50 read 14 ms to 120 ms, a regression of +778%."""
    rng = random.Random(seed)
    recs = [shaped("v1", round(rng.uniform(0.012, 0.016), 6), T0 + i, "short", i + 1) for i in range(24)]
    for i in range(36):
        shape, ttft = ("short", rng.uniform(0.012, 0.016)) if i % 3 == 0 else ("long", rng.uniform(0.11, 0.13))
        recs.append(shaped("v2", round(ttft, 6), T0 + 1800 + i, shape, 100 + i))
    return recs


@pytest.mark.parametrize("engine", ["python", "duckdb"])
def test_a_moved_mix_gets_no_pooled_verdict_but_one_per_route_and_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], engine: str
) -> None:
    recs = mix_records()
    path = write(tmp_path / "r.jsonl", recs)
    argv = ["compare", str(path), "--split-at", "2026-05-01T12:15:00Z", "--engine", engine]
    code, out, err = run([*argv, "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    # Today's code said "regression: TTFT p50 14 ms to 1xx ms": unlike with unlike.
    assert data["kind"] == "mix_moved" and data["verdict"].startswith("no pooled verdict: the mix of routes and shapes")
    assert "support long 0% to 67%, support short 100% to 33%" in data["verdict"]
    mix = data["mix"]
    assert mix["moved"] and mix["p_value"] < 0.001 and mix["shift"] == pytest.approx(2 / 3)
    strata = {(s["route"], s["shape"]): s for s in data["strata"]}
    assert (strata[("support", "long")]["before"], strata[("support", "long")]["after"]) == (0, 24)
    assert strata[("support", "long")]["kind"] == "insufficient"
    short = strata[("support", "short")]
    assert (short["before"], short["after"]) == (24, 12) and short["kind"] == "no_change", short["verdict"]
    # The slowest request of each side at or above its p99, by trace id.
    after = [r for r in recs if r["prompt_version"] == "v2"]
    slowest = max(after, key=lambda r: r["ttft"])
    assert data["after"]["at_or_above_p99"] == 1
    assert data["after"]["slowest"] == [
        {"ttft": slowest["ttft"], "trace_id": slowest["trace_id"], "route": "support", "shape": "long"}
    ]
    code, text, _ = run(argv, capsys)
    lines = text.strip().splitlines()
    assert lines[-1] == data["verdict"]
    assert "mix of routes and shapes (requests with a TTFT, before to after): support long 0% to 67%" in text
    assert f"{round(slowest['ttft'] * 1000)} ms  {slowest['trace_id']}  support long" in text
    assert "  after: 1 at or above p99 " in text


def test_a_held_mix_keeps_the_pooled_verdict_and_adds_one_per_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(4)
    recs = []
    for i in range(40):
        shape = "long" if i % 4 else "short"
        before, after = (0.78, 0.12) if shape == "long" else (0.05, 0.03)
        recs.append(shaped("v1", round(before * rng.uniform(0.97, 1.03), 6), T0 + i, shape, i + 1))
        recs.append(shaped("v2", round(after * rng.uniform(0.97, 1.03), 6), T0 + 900 + i, shape, 100 + i))
        recs[-1]["tokens"]["cache_read"] = 5000
    path = write(tmp_path / "r.jsonl", recs)
    code, out, err = run(["compare", str(path), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert not data["mix"]["moved"] and data["mix"]["p_value"] == pytest.approx(1.0) and data["mix"]["shift"] == 0
    assert data["kind"] == "gain" and data["verdict"].startswith("caching gain")
    # The short prompts' 20 ms gain counts: it is 40% of their 50 ms.
    assert [(s["shape"], s["kind"]) for s in data["strata"]] == [("long", "gain"), ("short", "gain")]
    code, text, _ = run(["compare", str(path)], capsys)
    assert ": held (chi-square p = 1.000, 0% of requests shifted)" in text
    assert "  support short  10/10  caching gain: TTFT p50 50 ms to 30 ms" in text


def test_an_unknown_version_or_route_is_answered_with_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "r.jsonl", mix_records())
    for engine in ("python", "duckdb"):
        # Today's code said "too few requests (24 before, 0 after)".
        code, out, err = run(["compare", str(path), "--before", "v1", "--after", "v3", "--engine", engine], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert "no requests of prompt version v3; versions seen: v2 (36 requests), v1 (24 requests)" in err
        code, _, err = run(["compare", str(path), "--before", "v0", "--after", "v1", "--route", "support"], capsys)
        assert "no requests of prompt version v0 with route support; versions seen: v2 (36" in err, err
        code, _, err = run(["compare", str(path), "--route", "chat", "--engine", engine], capsys)
        assert code == 2 and "no requests with route chat; routes seen: support (60 requests)" in err, err
        assert "shapes seen: long (24 requests), short (36 requests)" in err
        code, _, err = run(["slo", str(path), "--shape", "medium", "--engine", engine], capsys)
        assert code == 2 and "no requests with shape medium; routes seen: support (60 requests)" in err, err


def test_slo_names_the_slowest_requests_past_the_ttft_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = mix_records()
    for r in recs:
        r["objective"] = {"shape": r["shape"], "percentile": 0.9, "ttft": 0.1}
    path = write(tmp_path / "r.jsonl", recs)
    code, text, err = run(["slo", str(path)], capsys)
    assert code == 0, err
    past = sorted((r for r in recs if r["ttft"] > 0.1), key=lambda r: -r["ttft"])[:5]
    assert "slowest requests past the TTFT limit (by trace id):" in text
    rows = [" ".join(line.split()) for line in text.split("slowest requests past")[1].splitlines()[1:]]
    assert rows == [f"support long {round(r['ttft'] * 1000)} ms {r['trace_id']}" for r in past]


def test_min_gain_share_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "r.jsonl", gain_records())
    code, out, _ = run(["compare", str(path), "--min-gain-share", "90%", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["kind"] == "no_gain" and "(90% of the before p50, --min-gain-share)" in data["verdict"]
    code, out, _ = run(["compare", str(path), "--min-gain-share", "0.5", "--json"], capsys)
    assert json.loads(out)["kind"] == "gain"
    for bad in ("150%", "-1", "a lot"):
        code, _, err = run(["compare", str(path), "--min-gain-share", bad], capsys)
        assert code == 2 and "expected a share such as 10% or 0.1" in err, err


def test_plot_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "r.jsonl", gain_records())
    png = tmp_path / "ttft.png"
    code, out, err = run(["compare", str(path), "--plot", str(png)], capsys)
    assert code == 0, err
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000
    assert f"plot: {png}" in out


def test_a_prometheus_that_is_down_is_one_line_and_exit_2() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = subprocess.run(
        [sys.executable, "-m", "llmtap", "compare", "--prometheus", url, "--before", "v1", "--after", "v2"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and f"Prometheus at {url} is not reachable" in out.stderr, out.stderr


# -- the course's workloads on the simulator -------------------------------------------------------

PER_SIDE = 8
CONCURRENCY = 4
WORKLOADS = {"support": (5250, 950), "code": (120, 80)}  # unchanging and variable prompt tokens


def wait_until_up(url: str, proc: subprocess.Popen[bytes], what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + PATIENCE
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
            pytest.fail(f"{what} did not start\n{tail}")
        time.sleep(0.05)


@dataclass
class Stack:
    """Two simulated servers and the proxy in front of them, each in its own process, after the traffic."""

    proxy: str
    admin: str
    records: Path
    requests: int
    #: Each simulator's own records (``/debug/requests``) of the traffic, in the order the requests arrived.
    truth: dict[str, list[dict[str, Any]]]

    def server_ttft(self, route: str, side: str) -> list[float]:
        """The simulator's own TTFT (arrival to first token) of one side's requests, warm-ups left out.

        The phases run one after the other, each a warm-up and then ``PER_SIDE`` requests: v1 first, then v2.
        """
        records = self.truth[route]
        assert len(records) == 2 * (PER_SIDE + 1), len(records)
        start = 1 if side == "before" else PER_SIDE + 2
        return [r["first_token"] - r["arrival"] for r in records[start : start + PER_SIDE]]

    def planned_prefill(self, route: str, side: str) -> list[float]:
        """The prefill the simulator's profile set for each of one side's requests (its uncached tokens)."""
        records = self.truth[route]
        start = 1 if side == "before" else PER_SIDE + 2
        return [r["prefill_plan_s"] for r in records[start : start + PER_SIDE]]


async def drive(base: str) -> int:
    """Per workload: the variable part first (v1), then the unchanging part first (v2), warm-ups aside."""
    vocab = Vocabulary("o200k_base")
    sent = 0

    async def one(client: httpx.AsyncClient, route: str, layout: str, index: int, version: str) -> None:
        nonlocal sent
        fixed_n, variable_n = WORKLOADS[route]
        fixed = "".join(vocab.generate(f"{route}:fixed", fixed_n))
        variable = "".join(vocab.generate(f"{route}:{index}", variable_n))
        first, second = (fixed, variable) if layout == "fixed" else (variable, fixed)
        body = {
            "model": "llmtap-sim",
            "messages": [{"role": "system", "content": first}, {"role": "user", "content": second}],
            "max_tokens": 2,
            "stream": True,
        }
        url = f"{base}/{route}/v1/chat/completions"
        async with client.stream("POST", url, json=body, headers={"x-llmtap-prompt-version": version}) as r:
            assert r.status_code == 200
            await r.aread()
        sent += 1

    async def phase(client: httpx.AsyncClient, route: str, layout: str, version: str, offset: int) -> None:
        await one(client, route, layout, offset + 999, "warmup")
        sem = asyncio.Semaphore(CONCURRENCY)

        async def limited(i: int) -> None:
            async with sem:
                await one(client, route, layout, offset + i, version)

        await asyncio.gather(*(limited(i) for i in range(PER_SIDE)))

    async with httpx.AsyncClient(timeout=60) as client:
        for route in WORKLOADS:
            await phase(client, route, "variable", "v1", 0)
            await phase(client, route, "fixed", "v2", 1000)
    return sent


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("compare")
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "OTEL_SDK_DISABLED": "false"}
    try:
        # All three start at once; the proxy does not need its upstreams until traffic comes.
        sims = {profile: free_port() for profile in WORKLOADS}
        for profile, port in sims.items():
            cmd = [sys.executable, "-m", "llmtap", "simulate", "--profile", profile, "--port", str(port)]
            procs.append(subprocess.Popen(cmd, stderr=subprocess.DEVNULL, cwd=ROOT))
        config = tmp / "llmtap.yaml"
        routes = "".join(
            f"  - {{prefix: /{p}, upstream: 'http://127.0.0.1:{port}', provider: llmtap-sim, strip_prefix: true}}\n"
            for p, port in sims.items()
        )
        config.write_text("routes:\n" + routes)
        port, admin = free_port(), free_port()
        records = tmp / "records"
        cmd = [sys.executable, "-m", "llmtap", "serve", "--config", str(config), "--record", str(records)]
        cmd += ["--port", str(port), "--admin-port", str(admin), "--log-level", "warning"]
        log = (tmp / "proxy.log").open("wb")
        procs.append(subprocess.Popen(cmd, stderr=log, cwd=ROOT, env=env))
        log.close()
        for (profile, sim_port), proc in zip(sims.items(), procs, strict=False):
            wait_until_up(f"http://127.0.0.1:{sim_port}/v1/models", proc, f"the {profile} simulator")
        wait_until_up(f"http://127.0.0.1:{admin}/readyz", procs[-1], "the proxy", tmp / "proxy.log")
        sent = asyncio.run(drive(f"http://127.0.0.1:{port}"))
        # The records of the last requests are written by the proxy's worker just after their streams end.
        deadline = time.monotonic() + PATIENCE
        while len(list(read_records(records, ReadStats()))) < sent:
            assert time.monotonic() < deadline, "the proxy did not write every record"
            time.sleep(0.05)
        truth = {}
        for profile, sim_port in sims.items():
            answer = httpx.get(f"http://127.0.0.1:{sim_port}/debug/requests", timeout=PATIENCE).json()
            truth[profile] = sorted(answer["requests"], key=lambda r: r["arrival"])
        yield Stack(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", records, sent, truth)
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def compare_json(*args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "llmtap", "compare", *args, "--before", "v1", "--after", "v2", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


@pytest.mark.e2e
def test_support_assistant_shows_the_caching_gain(stack: Stack) -> None:
    data = compare_json(str(stack.records), "--route", "support")
    before, after = data["before"], data["after"]
    print("support:", data["verdict"])
    assert before["requests"] == after["requests"] == PER_SIDE and before["errors"] == after["errors"] == 0
    # The course's figures are the simulator's plan: 6,200 tokens read at 7,950 tokens/s; then 952 uncached
    # tokens (the unchanging part cached).
    assert within(statistics.median(stack.planned_prefill("support", "before")), 0.781)
    assert within(statistics.median(stack.planned_prefill("support", "after")), 0.121)
    # What the proxy measured is the server's own TTFT of the same requests and the hop to the proxy: never
    # earlier, and late by far less than the gain it reports. A busy machine makes the simulator late to its
    # plan (seen: 218 ms for the planned 121 ms under two busy loops), the server's figures and the proxy's alike.
    gain = statistics.median(stack.server_ttft("support", "before")) - statistics.median(
        stack.server_ttft("support", "after")
    )
    assert gain > 0.5, gain  # 0.66 s planned
    for side, measured in (("before", before), ("after", after)):
        server = statistics.median(stack.server_ttft("support", side))
        proxy = measured["ttft"]["p50"]["value"]
        print(f"support {side}: TTFT p50 {1000 * proxy:.0f} ms at the proxy, {1000 * server:.0f} ms at the server")
        assert server - 0.001 <= proxy < server + gain / 4, (side, proxy, server, gain)
    change = data["change"]["ttft_p50"]
    assert change["seconds"]["high"] < 0 and change["relative"]["high"] < 0  # the interval excludes zero
    assert before["cached_share"] == 0 and after["cached_share"] > 0.8
    assert before["classes"] == {"miss_changed": PER_SIDE} and after["classes"] == {"hit": PER_SIDE}
    assert data["kind"] == "gain" and data["verdict"].startswith("caching gain: TTFT p50 "), data["verdict"]


@pytest.mark.e2e
def test_code_completion_shows_a_small_real_gain(stack: Stack) -> None:
    data = compare_json(str(stack.records), "--route", "code")
    support = compare_json(str(stack.records), "--route", "support")
    print("code:", data["verdict"])
    # 200 tokens read in 25 ms: never faster, and a small share of the support prompt's read measured in the
    # same run (780 ms in the course); what a busy machine adds to both stays far below that gap.
    code_p50, support_p50 = data["before"]["ttft"]["p50"]["value"], support["before"]["ttft"]["p50"]["value"]
    assert 0.025 <= code_p50 < support_p50 / 10, (data["before"]["ttft"], support["before"]["ttft"])
    assert data["after"]["cached_share"] > 0.4  # the cache works, but there is little to save
    # Issue 30: the least gain that counts is a tenth of the before p50 (3 ms here), not a fixed 100 ms, so a
    # real gain of a few ms counts. Whether 8 requests a side make it real depends on the machine's load (the
    # unit tests hold the rule on fixed figures): the verdict is what the rule says of these figures.
    change = data["change"]["ttft_p50"]["seconds"]
    assert data["min_gain"] == pytest.approx(0.1 * code_p50, rel=1e-6)
    real, gain = change["high"] < 0, -change["value"]
    assert gain < 0.1  # below the old fixed bar: every such gain was "no significant" before
    if real and gain >= data["min_gain"]:
        assert data["kind"] == "gain" and data["verdict"].startswith("caching gain: TTFT p50 "), data["verdict"]
    else:
        assert data["kind"] in ("no_gain", "no_change") and data["verdict"].startswith("no significant"), data
    # A user who wants a gain a person notices says so: a real gain is then below the bar, and says why.
    strict = compare_json(str(stack.records), "--route", "code", "--min-gain-ms", "100")
    assert strict["kind"] in ("no_gain", "no_change") and strict["min_gain"] == 0.1
    assert ("below the 100 ms threshold (--min-gain-ms)" in strict["verdict"]) == real, strict["verdict"]


@pytest.mark.e2e
@pytest.mark.real
def test_compare_over_prometheus(stack: Stack, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    require_real(binary is not None, "Prometheus", "bash .ci/install.d/20-prometheus.sh")
    assert binary is not None
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: llmtap, static_configs: [{{targets: ['{stack.admin[len('http://') :]}']}}]}}]\n"
    )
    cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}"]
    cmd += [f"--web.listen-address=127.0.0.1:{port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url + "/-/ready", proc, "Prometheus")
        query = 'sum(llmtap_requests_total{llmtap_prompt_version=~"v1|v2"})'
        deadline = time.monotonic() + PATIENCE
        while True:
            result = httpx.get(url + "/api/v1/query", params={"query": query}).json()["data"]["result"]
            if result and float(result[0]["value"][1]) >= 2 * len(WORKLOADS) * PER_SIDE:
                break
            assert time.monotonic() < deadline, "Prometheus did not scrape the proxy"
            time.sleep(0.2)
        data = compare_json("--prometheus", url, "--route", "support")
        every = compare_json("--prometheus", url)
    finally:
        stop(proc)
    print("support, from Prometheus:", data["verdict"])
    before, after = data["before"], data["after"]
    assert before["requests"] == after["requests"] == PER_SIDE
    # Read back from buckets 9% apart: within 10% of the exact figures of the same requests (their records),
    # as the README says of any backend.
    exact = compare_json(str(stack.records), "--route", "support")
    for side in ("before", "after"):
        read, truth = data[side]["ttft"]["p50"]["value"], exact[side]["ttft"]["p50"]["value"]
        assert within(read, truth), (side, read, truth)
    assert data["change"]["ttft_p50"]["relative"]["high"] < 0
    assert after["cached_share"] > 0.8 and after["classes"] == {"hit": PER_SIDE}
    assert data["kind"] == "gain" and data["verdict"].startswith("caching gain")
    # Both routes: like with like from the TTFT histogram by route and shape, as from the records.
    exact_every = compare_json(str(stack.records))
    for got in (every, exact_every):
        strata = {(s["route"], s["shape"]): s for s in got["strata"]}
        assert sorted(strata) == sorted((s["route"], s["shape"]) for s in exact_every["strata"])
        assert {r for r, _ in strata} == set(WORKLOADS) and not got["mix"]["moved"], got["mix"]
        assert all((s["before"], s["after"]) == (PER_SIDE, PER_SIDE) for s in strata.values())
        support_long = next(s for (r, _), s in strata.items() if r == "support")
        assert support_long["kind"] == "gain", support_long["verdict"]
    assert next(s for s in every["strata"] if s["route"] == "support")["verdict"].startswith("TTFT gain: TTFT p50")
