"""The record store: which files a path names, and the engine held to the plain-Python reference.

The same records, read by DuckDB and by one pass of plain Python, must give EQUAL verdicts, figures and
intervals (same seed): over missing and wrong-typed fields, errors, non-streams, several versions,
routes and shapes, a time split and a version split, windows, the objectives records carry and those of
a config, and lines that are not records.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from llmtap import store
from llmtap.analysis.compare import Split
from llmtap.commands import compare, slo
from llmtap.config.types import SLO, ConfigError
from llmtap.store.engine import EngineSource
from llmtap.store.files import NoRecords, record_files
from llmtap.store.python import PythonSource

T0 = 1777636800.0  # 2026-05-01T12:00:00Z


def iso(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")


def hostile_record(rng: random.Random, i: int) -> dict[str, Any]:
    """One record with a fair chance of every kind of oddity a file can hold."""
    t = T0 + i * 7.3 + rng.random()
    route = rng.choice(("support", "support", "completion", "chat"))
    version: str | None = "v1" if t < T0 + 3600 else "v2"
    if route == "chat" and rng.random() < 0.1:
        version = "v3" if rng.random() < 0.5 else None  # a third version, and none, on one route only
    ok = rng.random() > 0.08
    stream = rng.random() < 0.85
    ttft = rng.lognormvariate(-1.0 if version == "v1" else -1.8, 0.5)
    rec: dict[str, Any] = {
        "llmtap_record": rng.choice((1, 1, 1, 2)),
        "time": iso(t),
        "route": route,
        "model": rng.choice(("m1", "m2")),
        "shape": rng.choice(("long", "short", "short")),
        "prompt_version": version,
        "outcome": "ok" if ok else rng.choice(("error", "cancelled")),
        "stream": stream,
        "slo": rng.choice(("met", "missed", None)),
        "ttft": round(ttft, 6) if stream else None,
        "tpot": round(rng.uniform(0.01, 0.06), 6) if rng.random() < 0.9 else None,
        "e2e": round(ttft + rng.uniform(0.5, 5), 6),
        "prefill": round(ttft * 0.8, 6) if rng.random() < 0.7 else None,
        "prefill_source": rng.choice(("estimated", "upstream_ttft", None)),
        "tokens": {"input": rng.randint(100, 8000), "cache_read": rng.choice((0, 512, 4096, None))},
        "cache": {"class": rng.choice(("hit", "miss_changed", "cold"))},
        "objective": {"shape": "long", "percentile": 0.95, "ttft": rng.choice((0.5, 0.8)), "tpot": 0.05},
        "trace_id": f"{rng.getrandbits(128):032x}",
    }
    if i % 3:  # the request's own objectives (x-slo-*): outcomes of both figures, one missing, one of a wrong type
        outcomes = ("met", "violated", None, "met", 5)
        rec["request_objective"] = {
            "ttft": 0.5,
            "tpot": 0.05,
            "ttft_outcome": outcomes[i % 5],
            "tpot_outcome": outcomes[(i // 5) % 4],
        }
    odd = rng.random()
    if odd < 0.02:
        rec["ttft"] = "0.5"  # a string is not a number
    elif odd < 0.04:
        rec["stream"] = "true"
    elif odd < 0.06:
        rec["tokens"] = [1, 2]
    elif odd < 0.08:
        rec["tokens"]["input"] = 12.5
    elif odd < 0.10:
        rec["objective"] = {"percentile": 1.5, "ttft": 0.5}
    elif odd < 0.12:
        rec["objective"] = {"percentile": 0.99, "e2e": True}
    elif odd < 0.14:
        del rec["route"]
    elif odd < 0.16:
        rec["shape"] = 7
    elif odd < 0.18:
        rec["time"] = "yesterday"
    elif odd < 0.19:
        rec["ttft"] = math.nan
    elif odd < 0.20:
        rec["e2e"] = True
    elif odd < 0.21:
        rec["time"] = iso(t).replace("+00:00", "Z")
    elif odd < 0.22:
        rec["outcome"] = 1
    elif odd < 0.23:
        rec["cache"] = None
    elif odd < 0.24:
        rec["time"] = " " + iso(t)  # read after a trim, as Python reads it
    elif odd < 0.25:
        rec["time"] = iso(t + 7200).replace("+00:00", "+02:00")  # another zone: the same moment
    elif odd < 0.26:
        rec["trace_id"] = None if odd < 0.255 else 12  # no trace id (either reads as ''): named anyway
    elif odd < 0.29:
        rec["ttft"] = 2.5  # slowest of its group, tied with others: the trace id breaks the tie
    first_tokens(rec, i)
    # A cost from the record's index, not the generator, so the other fields stay as they were:
    # priced (amounts exact in binary, so any order of summing agrees), unknown, absent, or wrong-typed.
    kind = i % 6
    if kind < 3:
        rec["cost"] = {"amount": (i % 97) / 2**20, "currency": "USD", "status": "priced", "prices": "file"}
    elif kind == 3:
        rec["cost"] = {"amount": None, "currency": "USD", "status": "unknown_model", "prices": None}
    elif kind == 4 and i % 4 == 0:
        rec["cost"] = {"amount": "0.5"}
    return rec


def first_tokens(rec: dict[str, Any], i: int) -> None:
    """A stream's TTFOT and TTST from the record's index (the generator's draws stay as they were): a third reason
    first (TTFOT past TTFT), a fifth is one chunk (no TTST), a few hold a wrong type; some routes' objectives bound
    them."""
    ttft = rec.get("ttft")
    if not isinstance(ttft, float) or ttft != ttft:
        rec["ttfot"] = rec["ttst"] = None
        return
    rec["ttfot"] = round(ttft + 0.2 + (i % 13) / 50, 6) if i % 3 == 0 else ttft
    rec["ttst"] = None if i % 5 == 0 else round(0.01 + (i % 17) / 400, 6)
    if i % 61 == 0:
        rec["ttst"] = "0.02"  # a string is not a number
    if rec.get("route") == "completion" and isinstance(rec.get("objective"), dict) and i % 2:
        rec["objective"] = {**rec["objective"], "ttfot": 0.6, "ttst": 0.04}


def odd_lines() -> str:
    """Lines that are not records, each counted by its reason."""
    return (
        '{"msg": "a line of some other log"}\n'  # foreign
        "[1, 2, 3]\n"  # foreign
        "not json at all\n"  # foreign
        '{"llmtap_record": 9, "time": "2026-05-01T12:00:00Z"}\n'  # other_schema
        '{"llmtap_record": "1"}\n'  # other_schema
        '{"llmtap_record": 1, "time": "2026-05-01T12:0\n'  # truncated: one of ours cut short
        "\n   \n"  # blank: no line at all
    )


def write_records(path: Path, recs: list[dict[str, Any]], extra: str = "", *, gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in recs) + extra
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three pods' files in the dataset layout, compressed and plain, one rotated legacy file, odd lines."""
    root = tmp_path_factory.mktemp("records")
    rng = random.Random(7)
    recs = [hostile_record(rng, i) for i in range(1500)]
    part = root / "date=2026-05-01" / "hour=12"
    part.mkdir(parents=True)
    write_records(part / "pod-a-1.jsonl.gz", recs[:500], odd_lines(), gz=True)
    write_records(part / "pod-b-1.jsonl", recs[500:900], odd_lines())
    # The same stem twice: only the .gz counts (the .jsonl is a leftover of the compression step).
    write_records(part / "pod-c-1.jsonl.gz", recs[900:1200], gz=True)
    write_records(part / "pod-c-1.jsonl", recs[900:1000])
    legacy = root / "old"
    legacy.mkdir()
    write_records(legacy / "records.jsonl.1", recs[1200:1400])
    # The last line cut short, as a killed proxy leaves it.
    write_records(legacy / "records.jsonl", recs[1400:], '{"llmtap_record": 1, "time": "2026')
    return root


def test_paths_globs_directories_and_one_copy_per_stem(dataset: Path) -> None:
    every = record_files([dataset])
    names = sorted(p.name for p in every)
    assert names == ["pod-a-1.jsonl.gz", "pod-b-1.jsonl", "pod-c-1.jsonl.gz", "records.jsonl", "records.jsonl.1"]
    # A file path brings its rotated siblings; a glob crosses directories; the same file twice counts once.
    assert [p.name for p in record_files([dataset / "old" / "records.jsonl"])] == ["records.jsonl.1", "records.jsonl"]
    globbed = record_files([str(dataset / "**" / "pod-*.jsonl*"), dataset / "date=2026-05-01"])
    assert sorted(p.name for p in globbed) == ["pod-a-1.jsonl.gz", "pod-b-1.jsonl", "pod-c-1.jsonl.gz"]
    with pytest.raises(NoRecords, match="no record file at"):
        record_files([dataset / "nowhere.jsonl", str(dataset / "*.parquet")])


def facts(scan: store.Scan) -> list[tuple[Any, ...]]:
    return sorted(
        (
            (g.key or "", g.route or "", g.shape or ""),
            g.requests,
            g.errors,
            g.met,
            g.first,
            g.last,
            g.input_tokens,
            g.cached_tokens,
            g.objective,
            g.objective_time,
            g.classes,
            g.prefill_sources,
            g.priced,
            g.cost,
            [list(getattr(g, a)) for a in ("ttft_ok", "ttft_failed", "prefill", "tpot", "e2e", "ttfot", "ttst")],
            g.slowest,
            g.request_objectives,
        )
        for g in scan.groups
    )


def test_the_engine_finds_the_same_facts_as_plain_python(dataset: Path) -> None:
    with EngineSource([dataset]) as engine:
        python = PythonSource([dataset])
        for where, by in [
            (store.Filter(), store.VERSION),
            (store.Filter(), None),
            (store.Filter(route="support", shape="long"), T0 + 3000.0),
            (store.Filter(model="m2", start=T0 + 1000, end=T0 + 6000, open_end=True), T0 + 3600.0),
        ]:
            a, b = engine.scan(where, by), python.scan(where, by)
            assert facts(a) == facts(b)
            assert (a.records, a.files, a.skipped) == (b.records, b.files, b.skipped)
        # 1500 records less the 100 duplicated by the leftover .jsonl; two files of odd lines, a cut last line;
        # the records without a readable time are in no window: counted apart.
        skipped = a.skipped
        no_time, wrong = skipped.pop("no_time"), skipped.pop("wrong_type")  # wrong-typed fields: read as null
        assert a.records + no_time == 1500 and no_time > 10 and 100 < wrong < a.records and a.files == 5
        assert skipped == {"truncated": 3, "foreign": 6, "other_schema": 4}
        limits = {
            ("support", "long"): {"ttft": 0.6, "tpot": 0.04},
            ("chat", "short"): {"e2e": 2.0},
            ("completion", "short"): {"ttfot": 0.5, "ttst": 0.04},
        }
        assert engine.count_met(store.Filter(), store.VERSION, limits) == python.count_met(
            store.Filter(), store.VERSION, limits
        )
        assert sum(engine.count_met(store.Filter(), None, limits).values()) > 0


def lookup(route: str, shape: str) -> SLO | None:
    return SLO(ttft=0.4, e2e=3.0, percentile=0.9) if route == "support" else None


@pytest.mark.parametrize(
    "split",
    [
        Split(),
        Split(before="v2", after="v1"),
        Split(before="v1", after="v3"),
        Split(at=T0 + 3600.0),
        Split(at=T0 + 3600.0, window=1800.0),
        Split(before="v1", after="v2", window=7200.0, until=T0 + 5000.0),
    ],
)
def test_compare_gives_equal_verdicts_figures_and_intervals_on_either_engine(dataset: Path, split: Any) -> None:
    out: list[dict[str, Any]] = []
    auto = split.at is None and split.before is None
    wheres: list[dict[str, str]] = [{"route": "support"}, {"route": "completion", "shape": "short"}]
    if not auto:  # two versions to find, where a third one is seen: say which
        wheres += [{}, {"shape": "short", "model": "m1"}]
    for engine in store.ENGINES:
        for where in wheres:
            try:
                sides = compare.record_sides([dataset], split, engine=engine, objectives=None, **where)
            except ConfigError as exc:  # v3 is on one route only: the others answer with the versions they hold
                out.append({"error": str(exc)})
                continue
            out.append(sides.compare(seed=3, resamples=300).to_json())
        try:
            judged = compare.record_sides([dataset], split, engine=engine, objectives=lookup, route="support")
        except ConfigError as exc:
            out.append({"error": str(exc)})
            continue
        out.append(judged.compare(seed=5, resamples=300).to_json())
    half = len(out) // 2
    assert out[:half] == out[half:]
    assert any(o.get("before", {}).get("ttft_requests", 0) > 5 and o["after"]["ttft_requests"] > 5 for o in out)
    errors = [o["error"] for o in out if "error" in o]
    if split.after == "v3":
        assert errors and all("no requests of prompt version v3 with route" in e for e in errors), errors
        assert "versions seen: v2 (" in errors[0] and "v1 (" in errors[0]
    else:
        assert not errors, errors
    assert any(v["checks"] for o in out if "slo" in o for side in o["slo"].values() for v in side)


@pytest.mark.parametrize(
    "options",
    [{}, {"window": 3000.0, "until": T0 + 6000.0}, {"route": "support"}, {"shape": "long"}, {"objectives": lookup}],
)
def test_slo_gives_equal_verdicts_on_either_engine(dataset: Path, options: dict[str, Any]) -> None:
    a, b = (slo.from_records([dataset], resamples=300, seed=2, engine=e, **options) for e in store.ENGINES)
    assert a.to_json() == b.to_json()
    assert a.verdicts and any(c.estimate is not None for v in a.verdicts for c in v.checks)


def test_parquet_reads_as_its_json_lines(tmp_path: Path) -> None:
    """The same records as Parquet (the record's nested structure) give the same comparison."""
    import duckdb

    rng = random.Random(11)
    recs = [hostile_record(rng, i) for i in range(600)]
    # Parquet columns have one type each: keep the records whose fields have the usual types.
    typed = [
        r
        for r in recs
        if isinstance(r.get("ttft"), float | type(None))
        and r.get("ttft") == r.get("ttft")
        and isinstance(r.get("stream"), bool)
        and isinstance(r.get("tokens"), dict)
        and isinstance(r["tokens"].get("input"), int)
        and isinstance(r.get("shape"), str)
        and isinstance(r.get("trace_id"), str | type(None))
        and isinstance(r.get("outcome"), str)
        and isinstance(r.get("e2e"), float)
        and isinstance(r.get("cache"), dict)
        and "route" in r
        and set(r["objective"]) <= {"shape", "percentile", "ttft", "tpot", "ttfot", "ttst"}
        and {"shape", "percentile", "ttft", "tpot"} <= set(r["objective"])
        and isinstance(r.get("ttst"), float | type(None))
        and not isinstance((r.get("cost") or {}).get("amount"), str)
        and not any(isinstance(v, int) for v in (r.get("request_objective") or {}).values())
    ]
    lines = write_records(tmp_path / "a.jsonl", typed)
    con = duckdb.connect()
    con.execute(f"COPY (SELECT * FROM read_json_auto('{lines}')) TO '{tmp_path / 'b.parquet'}' (FORMAT parquet)")
    con.close()
    split = Split(at=T0 + 2000.0)
    from_lines = compare.record_sides([lines], split, engine="python").compare(seed=1, resamples=300)
    from_parquet = compare.record_sides([tmp_path / "b.parquet"], split).compare(seed=1, resamples=300)
    assert from_lines.to_json() | {"source": ""} == from_parquet.to_json() | {"source": ""}
    timed = [r for r in typed if r["time"] != "yesterday"]  # a record without a time is in no window
    assert from_parquet.before.requests + from_parquet.after.requests == len(timed) > 300


def test_without_the_analysis_extra_plain_python_reads_and_naming_duckdb_says_what_to_install(
    dataset: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """DuckDB and numpy are the analysis extra (the serve image leaves them out): without them the default
    engine is plain Python, with the same verdicts and a note on stderr; ``--engine duckdb`` is one clear line."""
    from llmtap import cli

    assert store.default_engine() == "duckdb"  # installed here: the default, and no note
    assert cli.main(["slo", str(dataset), "--resamples", "300"]) in (0, 1)
    assert "plain Python" not in capsys.readouterr().err
    with_duckdb = slo.from_records([dataset], resamples=300, seed=2).to_json()

    monkeypatch.setitem(sys.modules, "duckdb", None)  # `import duckdb` raises ImportError, find_spec finds none
    assert store.default_engine() == "python"
    assert not store.engine_installed("duckdb") and store.engine_installed("python")
    assert slo.from_records([dataset], resamples=300, seed=2).to_json() == with_duckdb
    with pytest.raises(ConfigError, match=r"duckdb engine needs duckdb and numpy.*pip install 'llmtap\[analysis\]'"):
        slo.open_source([dataset], "duckdb")
    assert cli.main(["compare", str(dataset), "--route", "support", "--resamples", "300"]) == 0
    out = capsys.readouterr()
    assert "caching gain" in out.out or "no significant gain" in out.out, out.out
    assert "the records are read in plain Python (the embedded engine is not installed: pip install" in out.err
    assert cli.main(["slo", str(dataset), "--engine", "duckdb"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'llmtap[analysis]'" in err and "Traceback" not in err, err


def reasoning_records(n: int = 240) -> list[dict[str, Any]]:
    """Successful streams of two versions, every third reasoning first (its TTFOT 0.5 s past its TTFT), every fifth
    of one content chunk (no TTST); and non-streams, which have neither. v2 answers faster."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        version = "v1" if i < n // 2 else "v2"
        stream = i % 8 != 7
        ttft = (0.30 if version == "v1" else 0.20) + (i % 10) / 100
        rec: dict[str, Any] = {
            "llmtap_record": 2,
            "time": iso(T0 + i),
            "record_id": f"r{i:06d}",
            "route": "support",
            "model": "m1",
            "shape": "long",
            "prompt_version": version,
            "outcome": "ok",
            "stream": stream,
            "ttft": round(ttft, 6) if stream else None,
            "ttfot": (round(ttft + 0.5, 6) if i % 3 == 0 else round(ttft, 6)) if stream else None,
            "ttst": round(0.02 + (i % 7) / 1000, 6) if stream and i % 5 else None,
            "tpot": 0.02,
            "e2e": round(ttft + 1.0, 6),
            "tokens": {"input": 1000, "cache_read": 0},
            "objective": {"shape": "long", "percentile": 0.9, "ttft": 1.0, "ttfot": 0.6, "ttst": 0.05},
        }
        out.append(rec)
    return out


def _exact(recs: list[dict[str, Any]], figure: str, version: str, q: float) -> float | None:
    from llmtap.analysis.stats import sorted_quantile

    values = sorted(r[figure] for r in recs if r["prompt_version"] == version and r[figure] is not None)
    return sorted_quantile(values, q)


@pytest.mark.parametrize("kind", ["python", "duckdb", "parquet"])
def test_compare_and_slo_read_ttfot_and_ttst_beside_ttft(tmp_path: Path, kind: str) -> None:
    """TTFOT and TTST percentiles stand beside TTFT in ``compare`` and can be objectives of ``slo``: exact at the
    point estimate on each engine and from Parquet; a stream of one chunk has no TTST (left out, not a 0), a
    non-stream neither."""
    recs = reasoning_records()
    path = write_records(tmp_path / "r.jsonl", recs)
    engine = "python" if kind == "python" else "duckdb"
    if kind == "parquet":
        import duckdb

        con = duckdb.connect()
        con.execute(f"COPY (SELECT * FROM read_json_auto('{path}')) TO '{tmp_path / 'r.parquet'}' (FORMAT parquet)")
        con.close()
        path = tmp_path / "r.parquet"
    c = compare.record_sides([path], Split(before="v1", after="v2"), engine=engine).compare(seed=1, resamples=300)
    streams = [r for r in recs if r["stream"]]
    for side, version in ((c.before, "v1"), (c.after, "v2")):
        mine = [r for r in streams if r["prompt_version"] == version]
        assert side.ttfot_requests == len(mine) == side.ttft_requests
        assert side.ttst_requests == len([r for r in mine if r["ttst"] is not None]) < len(mine)
        for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
            ttfot, ttst = side.ttfot[name], side.ttst[name]
            assert ttfot is not None and ttst is not None
            assert ttfot.value == pytest.approx(_exact(recs, "ttfot", version, q))
            assert ttst.value == pytest.approx(_exact(recs, "ttst", version, q))
        # Reasoning first: the answer's first token comes after the first token.
        ttfot95, ttft95 = side.ttfot["p95"], side.ttft["p95"]
        assert ttfot95 is not None and ttft95 is not None and ttfot95.value > ttft95.value
    assert c.change["ttfot_p50"] is not None and c.change["ttfot_p50"]["seconds"].value < 0
    text = compare.render(c)
    assert "TTFOT p50" in text and "TTST p99" in text and "a stream of one chunk has none" in text
    # The TTFT figures and the verdict are the same with or without the first-token figures beside them.
    plain = [{k: v for k, v in r.items() if k not in ("ttfot", "ttst")} for r in recs]
    plain_path = write_records(tmp_path / "plain.jsonl", plain)
    without = compare.record_sides([plain_path], Split(before="v1", after="v2"), engine="python")
    bare = without.compare(seed=1, resamples=300)
    assert bare.before.ttfot_requests == 0 and "TTFOT p50" not in compare.render(bare)
    assert (bare.before.ttft, bare.after.ttft, bare.verdict) == (c.before.ttft, c.after.ttft, c.verdict)

    # slo: the records' objective bounds TTFOT (p90 <= 600 ms: a third of the streams reason for 500 ms) and TTST.
    report = slo.from_records([path], resamples=300, seed=2, engine=engine)
    (verdict,) = report.verdicts
    checks = {c.figure: c for c in verdict.checks}
    assert set(checks) == {"ttft", "ttfot", "ttst"}
    assert checks["ttfot"].requests == len(streams) and checks["ttst"].requests == len(
        [r for r in streams if r["ttst"] is not None]
    )
    assert checks["ttfot"].verdict == "missed" and checks["ttst"].verdict == "met" and checks["ttft"].verdict == "met"
    assert verdict.verdict == "missed"
    assert "p90 TTFOT <= 600 ms" in slo.render(report)
    # --config's objectives on them: the source counts the requests that met them as the proxy judges them.
    lenient = slo.from_records(
        [path], resamples=300, seed=2, engine=engine, objectives=lambda r, s: SLO(ttfot=1.0, ttst=0.022, percentile=0.9)
    )
    (judged,) = lenient.verdicts
    assert [(c.figure, c.verdict) for c in judged.checks] == [("ttfot", "met"), ("ttst", "missed")]
    within = [r for r in recs if (r["ttst"] or 0.0) <= 0.022 and (r["ttfot"] or 0.0) <= 1.0]
    assert judged.met == len(within) < len(recs)
