"""Damaged record files: every kind of damage a record folder can hold, read by either engine.

Each case is a folder of good records plus one damaged thing. Either engine must answer with exit 0, no
traceback, one line on standard error for the cause that names the damaged file, and the comparison of the
good records and of what could be read of the damaged thing (the rows before a gzip's damage): the same as
the plain-Python reference gives for those records written cleanly. When nothing is left to read, a clear
error and exit 2. Then sweeps: a gzip and a Parquet file cut at many offsets, a Parquet file with a byte
spoiled at many offsets (never an exception, the engines agree, a longer prefix never reads fewer records);
and records read more than once, in files and parts of every kind, counted once.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st

from llmtap import cli, store
from llmtap.store import engine as engine_module, engine_sql
from llmtap.store.engine import EngineSource
from llmtap.store.python import PythonSource
from tests.conftest import require_real

T0 = 1790000000.0
COMPARE = ["compare", "--json", "--before", "v1", "--after", "v2", "--resamples", "200", "--seed", "4"]


def make(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` records of two prompt versions, each with its own ids (``seed`` keeps sets apart)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        version = "v1" if rng.random() < 0.5 else "v2"
        ttft = rng.lognormvariate(-0.6 if version == "v1" else -1.4, 0.4)
        out.append(
            {
                "llmtap_record": 2,
                "time": datetime.fromtimestamp(T0 + seed * 10_000 + i, UTC).isoformat(timespec="milliseconds"),
                "trace_id": f"{seed:08x}{i:024x}",
                "span_id": f"{seed + 1:04x}{i:012x}",
                "route": rng.choice(("chat", "code")),
                "model": "m1",
                "shape": rng.choice(("short", "long")),
                "prompt_version": version,
                "outcome": "ok" if rng.random() > 0.05 else "error",
                "stream": True,
                "ttft": round(ttft, 6),
                "tpot": round(rng.uniform(0.01, 0.05), 6),
                "e2e": round(ttft + rng.uniform(0.5, 2), 6),
                "tokens": {"input": 1000, "cache_read": 0 if version == "v1" else 512},
                "cache": {"class": "cold" if version == "v1" else "hit"},
            }
        )
    return out


def lines(recs: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in recs).encode()


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def complete_lines(data: bytes) -> int:
    """The complete lines a cut-short gzip holds before its damage (as far as zlib decompresses it)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        text = d.decompress(data)
    except zlib.error:
        return 0
    return text.count(b"\n")


def write_parquet(path: Path, recs: list[dict[str, Any]]) -> None:
    import duckdb

    src = path.with_suffix(".src.json")
    src.write_bytes(lines(recs))
    con = duckdb.connect()
    con.execute(f"COPY (SELECT * FROM read_json_auto('{src}')) TO '{path}' (FORMAT parquet)")
    con.close()
    src.unlink()


@dataclass
class Case:
    """One kind of damage: what it writes into the folder, the records of it that can be read, and the cause
    each engine names (``None``: nothing to say)."""

    name: str
    write: Callable[[Path, list[dict[str, Any]]], list[dict[str, Any]]]
    causes: dict[str, str | None] = field(default_factory=dict)  # engine -> the cause's words on stderr
    named: str = ""  # the file the cause names


def _cut_gzip(folder: Path, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    data = gzip.compress(lines(extra))
    cut = data[: len(data) * 2 // 3]
    (folder / "cut.jsonl.gz").write_bytes(cut)
    return extra[: complete_lines(cut)]


def _file(name: str, body: bytes, keep: bool = True) -> Callable[[Path, list[dict[str, Any]]], list[dict[str, Any]]]:
    def write(folder: Path, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
        (folder / name).write_bytes(body)
        return extra if keep else []

    return write


def _with_lines(name: str, odd: list[bytes], *, gz: bool = False, crlf: bool = False) -> Any:
    def write(folder: Path, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
        good = [json.dumps(r).encode() + (b"\r" if crlf and i % 2 else b"") for i, r in enumerate(extra)]
        body = b"\n".join(good[:20] + odd + good[20:]) + b"\n"
        (folder / name).write_bytes(gzip.compress(body) if gz else body)
        return extra

    return write


def _odd_entry(kind: str) -> Callable[[Path, list[dict[str, Any]]], list[dict[str, Any]]]:
    def write(folder: Path, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if kind == "directory":
            (folder / "dir.jsonl.gz").mkdir()
        elif kind == "pipe":
            os.mkfifo(folder / "pipe.jsonl")
        else:
            (folder / "link.jsonl.gz").symlink_to(folder / "nowhere")
        return []

    return write


def _parquet(kind: str) -> Callable[[Path, list[dict[str, Any]]], list[dict[str, Any]]]:
    def write(folder: Path, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
        path = folder / "x.parquet"
        if kind == "empty":
            path.write_bytes(b"")
        elif kind == "garbage":
            path.write_bytes(b"PAR1 this is not a Parquet file at all, just bytes PAR1"[5:])
        else:
            write_parquet(path, [{"user": "u1", "clicks": 3}] if kind == "other" else extra)
            if kind == "cut":
                data = path.read_bytes()
                path.write_bytes(data[: len(data) // 2])
        return []

    return write


def _no_time(folder: Path, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for r in extra[:5]:
        r["time"] = "yesterday"
    (folder / "odd.jsonl").write_bytes(lines(extra))
    return extra[5:]


def _wrong_types(folder: Path, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    extra[0]["ttft"], extra[1]["stream"], extra[2]["tokens"], extra[3]["outcome"] = "fast", "yes", [1], 7
    (folder / "odd.jsonl").write_bytes(lines(extra))
    return extra  # read, each wrong-typed field as null, as the reference reads it


LONG = b'{"llmtap_record": 2, "pad": "' + b"x" * (1 << 21) + b'"}'
CASES = [
    Case("gzip cut short", _cut_gzip, {"*": "read 1 damaged file up to the damage"}, "cut.jsonl.gz"),
    Case("empty gzip", _file("e.jsonl.gz", b"", keep=False), {"*": "damaged file"}, "e.jsonl.gz (empty)"),
    Case("zero-byte JSON lines (a file just opened)", _file("z.jsonl", b"", keep=False), {"*": None}),
    Case("zero-byte Parquet", _parquet("empty"), {"*": "damaged file"}, "x.parquet (empty)"),
    Case("garbage named .parquet", _parquet("garbage"), {"*": "damaged file"}, "x.parquet (not Parquet)"),
    Case("Parquet cut short", _parquet("cut"), {"*": "damaged file"}, "x.parquet (Parquet cut short)"),
    Case(
        "Parquet of other columns",
        _parquet("other"),
        {"duckdb": "1 file holding no records", "python": "1 unreadable file"},
        "x.parquet",
    ),
    Case("text named .gz", _file("t.jsonl.gz", b"hello\n", keep=False), {"*": "damaged"}, "t.jsonl.gz (not gzip)"),
    Case(
        "gzip with bytes after its end",
        lambda folder, extra: _file("g.jsonl.gz", gzip.compress(lines(extra)) + b"garbage")(folder, extra),
        {"*": "read 1 damaged file up to the damage"},
        "g.jsonl.gz (compressed data corrupt",
    ),
    Case(
        "lines not UTF-8",
        _with_lines("u.jsonl", [b"\xff\xfe{}", b'{"llmtap_record": 2, "x": "\xc3"}']),
        {"*": "2 lines that are not UTF-8"},
        "u.jsonl (2)",
    ),
    Case(
        "JSON that is not an object",
        _with_lines("j.jsonl", [b"[1, 2]", b'"s"', b"42", b"null", b"true"]),
        {"*": "5 lines that are not records"},
        "j.jsonl (5)",
    ),
    Case(
        "a line of 2 MiB",
        _with_lines("l.jsonl.gz", [LONG], gz=True),
        {"*": f"1 line longer than {1 << 20} bytes"},
        "l.jsonl.gz (1)",
    ),
    Case(
        "stray carriage return and delimiter",
        _with_lines("c.jsonl", [b"foo\rbar", b"a\x01b", b'{"llmtap_record": 2, \x01']),
        {"*": "skipped 2 lines that are not records"},
        "c.jsonl (2)",
    ),
    Case("mixed line endings", _with_lines("m.jsonl", [], crlf=True), {"*": None}),
    Case(
        "a torn last line",
        _file("t.jsonl", b'{"llmtap_record": 2, "time": "2026', keep=False),
        {"*": "1 line cut short"},
        "t.jsonl (1)",
    ),
    Case(
        "another schema version",
        _with_lines("s.jsonl", [b'{"llmtap_record": 9}']),
        {"*": "1 line of a record schema version"},
        "s.jsonl (1)",
    ),
    Case("records without a time", _no_time, {"*": "5 records without a readable time"}, "odd.jsonl (5)"),
    Case(
        "records with fields of the wrong type",
        _wrong_types,
        # tokens as a list holds no tokens.input of the wrong type: three of the four
        {"*": "read 3 records with a field of the wrong type (each such field as null)"},
    ),
    Case(
        "a directory named like a record file",
        _odd_entry("directory"),
        {"*": "1 unreadable file"},
        "dir.jsonl.gz (a directory)",
    ),
    Case(
        "a pipe named like a record file",
        _odd_entry("pipe"),
        {"*": "1 unreadable file"},
        "pipe.jsonl (not a regular file)",
    ),
    Case(
        "a broken link named like a record file",
        _odd_entry("link"),
        {"*": "1 unreadable file"},
        "link.jsonl.gz (a broken link)",
    ),
]


@pytest.fixture(scope="module")
def good() -> list[dict[str, Any]]:
    return make(300, seed=1)


def _folder(root: Path, good: list[dict[str, Any]]) -> Path:
    root.mkdir(parents=True)
    (root / "a.jsonl.gz").write_bytes(gzip.compress(lines(good[:200])))
    (root / "b.jsonl").write_bytes(lines(good[200:]))
    return root


def _comparable(text: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(text)
    out.pop("source")
    out.pop("skipped", None)
    return out


@pytest.mark.parametrize("engine", store.ENGINES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_damaged_file_is_named_counted_and_the_rest_compared(
    case: Case, engine: str, good: list[dict[str, Any]], tmp_path: Path
) -> None:
    folder = _folder(tmp_path / "damaged", good)
    kept = case.write(folder, make(60, seed=2))
    reference = _folder(tmp_path / "clean", good)
    (reference / "kept.jsonl").write_bytes(lines(kept))
    code, out, err = run([*COMPARE, "--engine", engine, str(folder)])
    assert code == 0 and "Traceback" not in err, err
    _, want, _ = run([*COMPARE, "--engine", "python", str(reference)])
    assert _comparable(out) == _comparable(want)
    said = case.causes.get(engine, case.causes.get("*"))
    if said is None:
        assert err == "", err
    else:
        hits = [line for line in err.splitlines() if said in line]
        assert len(hits) == 1 and case.named in hits[0] and hits[0].startswith("llmtap: "), err
        assert len(err.splitlines()) <= 2, err  # the cause, and a line cut short where the damage cut one
    slo = ["slo", "--json", "--resamples", "200", "--engine", engine]
    code, out, slo_err = run([*slo, str(folder)])
    assert code == 0 and slo_err == err
    assert _comparable(out) == _comparable(run([*slo[:-1], "python", str(reference)])[1])


@pytest.mark.parametrize("engine", store.ENGINES)
def test_nothing_readable_is_a_clear_error(engine: str, tmp_path: Path) -> None:
    (tmp_path / "a.jsonl.gz").write_bytes(b"")
    (tmp_path / "b.parquet").write_bytes(b"no")
    (tmp_path / "c.jsonl").write_bytes(b"[1]\n")
    code, out, err = run([*COMPARE, "--engine", engine, str(tmp_path)])
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("llmtap: error: no record could be read from ") and err.count("\n") == 1, err
    assert "damaged files" in err and "a.jsonl.gz (empty)" in err and "1 line that is not a record" in err


def test_a_file_that_cannot_be_opened_is_named_and_the_rest_compared(
    good: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Permission denied, as a process without the right to read it meets it (root drops its override)."""
    folder = _folder(tmp_path / "records", good)
    (folder / "locked.jsonl.gz").write_bytes(gzip.compress(lines(make(50, seed=3))))
    (folder / "locked.jsonl.gz").chmod(0)
    (folder / "sub").mkdir()
    (folder / "sub" / "hidden.jsonl").write_bytes(lines(make(5, seed=4)))
    (folder / "sub").chmod(0)  # a folder that cannot be listed: its files would be missed in silence
    prefix: list[str] = []
    if os.geteuid() == 0:
        capsh = shutil.which("capsh")
        require_real(capsh is not None, "capsh (to drop root's right to read any file)", "apt-get install libcap2-bin")
        prefix = [str(capsh), "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", 'exec "$0" "$@"']
    outputs = []
    for engine in store.ENGINES:
        cmd = [*prefix, sys.executable, "-m", "llmtap", *COMPARE, "--engine", engine, str(folder)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        where = folder.resolve()
        assert done.stderr == (
            f"llmtap: skipped 2 unreadable files: {where}/locked.jsonl.gz (permission denied), "
            f"{where}/sub (a folder that cannot be listed: Permission denied)\n"
        )
        outputs.append(_comparable(done.stdout))
    _, want, _ = run([*COMPARE, "--engine", "python", str(_folder(tmp_path / "clean", good))])
    assert outputs[0] == outputs[1] == _comparable(want)
    (folder / "sub").chmod(0o755)  # for the clean-up


def _scan(engine: str, folder: Path) -> store.Scan:
    source = PythonSource([folder]) if engine == "python" else EngineSource([folder])
    try:
        return source.scan(store.Filter(), store.VERSION)
    finally:
        source.close()


def _facts(scan: store.Scan) -> list[Any]:
    return sorted(
        ((g.key or "", g.route or "", g.shape or ""), g.requests, g.errors, list(g.ttft_ok), list(g.e2e), g.classes)
        for g in scan.groups
    )


def _offsets(size: int, n: int = 40) -> list[int]:
    """Every cut in the first and last 24 bytes (headers, trailers), and ``n`` spread over the rest."""
    return sorted({*range(min(24, size)), *range(max(0, size - 24), size), *(size * k // n for k in range(1, n))})


def test_a_gzip_cut_at_any_byte_reads_up_to_the_cut_in_either_engine(tmp_path: Path) -> None:
    recs = make(400, seed=5)
    data = gzip.compress(lines(recs))
    folder = tmp_path / "sweep"
    folder.mkdir()
    (folder / "good.jsonl").write_bytes(lines(make(30, seed=6)))
    before = -1
    for cut in [*_offsets(len(data)), len(data)]:
        (folder / "cut.jsonl.gz").write_bytes(data[:cut])
        a, b = (_scan(engine, folder) for engine in store.ENGINES)
        assert (a.records, a.skipped, _facts(a)) == (b.records, b.skipped, _facts(b)), cut
        assert a.records >= before and 30 <= a.records <= 430, cut
        before = a.records
        whole = cut == len(data)
        assert a.skipped.get("damaged", 0) == (0 if whole else 1) and (a.records == 430 or not whole), (cut, a.skipped)
        assert a.records - 30 in (complete_lines(data[:cut]), complete_lines(data[:cut]) + 1), cut


def test_a_parquet_file_cut_or_spoiled_anywhere_never_stops_the_engine(tmp_path: Path) -> None:
    folder = tmp_path / "sweep"
    folder.mkdir()
    write_parquet(folder / "p.parquet", make(300, seed=7))
    data = (folder / "p.parquet").read_bytes()
    (folder / "good.jsonl").write_bytes(lines(make(30, seed=8)))
    for cut in _offsets(len(data), 30):
        (folder / "p.parquet").write_bytes(data[:cut])
        scan = _scan("duckdb", folder)
        assert scan.records == 30 and scan.skipped == {"damaged": 1}, (cut, scan.skipped)
    for at in _offsets(len(data), 60):
        spoiled = bytearray(data)
        spoiled[at] ^= 0x5A
        (folder / "p.parquet").write_bytes(bytes(spoiled))
        scan = _scan("duckdb", folder)  # a value may read wrong (Parquet's pages carry no checksum): never a stop
        assert 30 <= scan.records <= 330, (at, scan.skipped)
        assert scan.records == 330 or scan.skipped, (at, scan.records)


def test_a_record_read_twice_counts_once_wherever_the_copy_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A journal's replay: copies in a later file, in the same file, in a damaged gzip (read up to the damage),
    in a Parquet file (the engine only), across the engine's parts and the buckets of files it reads again: the
    same comparison as the records once."""
    recs = make(500, seed=9)
    once = tmp_path / "once"
    once.mkdir()
    (once / "all.jsonl").write_bytes(lines(recs))
    twice = tmp_path / "twice"
    twice.mkdir()
    (twice / "a.jsonl.gz").write_bytes(gzip.compress(lines(recs[:300] + recs[50:60])))  # ten again in one file
    (twice / "b.jsonl").write_bytes(lines(recs[250:500]))  # fifty again in a later file
    cut = gzip.compress(lines(recs[100:200]))
    (twice / "c.jsonl.gz").write_bytes(cut[: len(cut) // 2])  # copies in a damaged file
    for i in range(12):  # many small files: the engine's parts, a copy in each
        (twice / f"d{i:02d}.jsonl").write_bytes(lines([recs[i * 40]]))
    monkeypatch.setattr(engine_module, "PART_FILES", 8)  # parts, and buckets of a part's files read again alone
    monkeypatch.setattr(engine_module, "BUCKET", 3)
    monkeypatch.setattr(engine_sql, "BUCKET", 3)
    _, want, _ = run([*COMPARE, "--engine", "python", str(once)])
    for engine in store.ENGINES:
        code, out, err = run([*COMPARE, "--engine", engine, str(twice)])
        assert code == 0 and _comparable(out) == _comparable(want), err
        copies = json.loads(out)["skipped"]["duplicate"]
        assert copies >= 10 + 50 + 12 and f"counted once {copies} records read more than once" in err
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    write_parquet(parquet / "a.parquet", recs[:300])
    write_parquet(parquet / "b.parquet", recs[200:])
    (parquet / "c.jsonl").write_bytes(lines(recs[290:310]))
    code, out, err = run([*COMPARE, "--engine", "duckdb", str(parquet)])
    assert code == 0 and _comparable(out) == _comparable(want) and json.loads(out)["skipped"] == {"duplicate": 120}


def _untraced(recs: list[dict[str, Any]], seed: int, *, record_ids: bool = True) -> list[dict[str, Any]]:
    """``recs`` as a proxy with tracing off writes them: trace and span ids all zeros (W3C's invalid ids), each with
    its own ``record_id`` (none in a record of an older version), and an objective for ``slo`` to judge by."""
    for i, rec in enumerate(recs):
        rec["trace_id"], rec["span_id"] = "0" * 32, "0" * 16
        if record_ids:
            rec["record_id"] = f"{seed:08x}{i:024x}"
        rec["objective"] = {"shape": rec["shape"], "percentile": 0.95, "ttft": 0.4}
        rec["slo"] = "met" if rec["outcome"] == "ok" and rec["ttft"] <= 0.4 else "missed"
    return recs


def test_records_without_tracing_read_twice_count_once_by_their_record_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tracing off, every record has the same (invalid) trace and span ids: what tells a journal's replayed copy
    from another request is the record_id. Copies in a later file, the same file, a gzip and Parquet count once in
    either engine, for compare and slo alike; records of an older version without ids count as they are, each
    time (nothing tells their copies apart)."""
    recs = _untraced(make(400, seed=11), seed=11)
    old = _untraced(make(6, seed=12), seed=12, record_ids=False)
    once = tmp_path / "once"
    once.mkdir()
    (once / "all.jsonl").write_bytes(lines(recs + old + old))
    twice = tmp_path / "twice"
    twice.mkdir()
    (twice / "a.jsonl.gz").write_bytes(gzip.compress(lines(recs[:300] + old + recs[10:20])))  # ten in one file
    (twice / "b.jsonl").write_bytes(lines(recs[200:] + old))  # a hundred again in a later file
    for i in range(12):  # many small files: the engine's parts and buckets, a copy in each
        (twice / f"d{i:02d}.jsonl").write_bytes(lines([recs[i * 30]]))
    monkeypatch.setattr(engine_module, "PART_FILES", 8)
    monkeypatch.setattr(engine_module, "BUCKET", 3)
    monkeypatch.setattr(engine_sql, "BUCKET", 3)
    slo = ["slo", "--json", "--resamples", "200", "--engine"]
    _, want, _ = run([*COMPARE, "--engine", "python", str(once)])
    _, want_slo, _ = run([*slo, "python", str(once)])
    assert json.loads(want)["before"]["requests"] + json.loads(want)["after"]["requests"] == 412
    for engine in store.ENGINES:
        code, out, err = run([*COMPARE, "--engine", engine, str(twice)])
        assert code == 0 and _comparable(out) == _comparable(want), err
        assert json.loads(out)["skipped"] == {"duplicate": 10 + 100 + 12}, err
        assert "counted once 122 records read more than once (the same record id)" in err
        code, out, err = run([*slo, engine, str(twice)])
        assert code in (0, 1) and _comparable(out) == _comparable(want_slo), err
        assert "counted once 122 records read more than once" in err
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    write_parquet(parquet / "a.parquet", recs[:300] + old)
    write_parquet(parquet / "b.parquet", recs[200:] + old)
    (parquet / "c.jsonl").write_bytes(lines(recs[290:310]))
    code, out, err = run([*COMPARE, "--engine", "duckdb", str(parquet)])
    assert code == 0 and _comparable(out) == _comparable(want) and json.loads(out)["skipped"] == {"duplicate": 120}


_ODD_BYTES = [
    b"\r",
    b"\x01",
    b"\xff",
    b"\xc3",
    b"\x00",
    b"\x0c",
    b" ",
    b"\t",
    b'"',
    b"{",
    b"}",
    b"[",
    b"\\",
    b"0",
    b"x",
]


@st.composite
def _line(draw: st.DrawFn) -> bytes:
    """A line of a damaged record file: a record, one cut short, one with a stray byte, or bytes of any kind."""
    rec = json.dumps(make(1, seed=draw(st.integers(20, 10_000)))[0]).encode()
    kind = draw(st.sampled_from(("record", "cut", "spoiled", "noise", "json")))
    if kind == "record":
        return rec
    if kind == "cut":
        return rec[: draw(st.integers(0, len(rec) - 1))]
    if kind == "spoiled":
        at = draw(st.integers(0, len(rec) - 1))
        return rec[:at] + draw(st.sampled_from(_ODD_BYTES)) + rec[at + 1 :]
    if kind == "json":
        return draw(st.sampled_from((b"[1]", b"null", b'"s"', b"1e999", b'{"llmtap_record": "2"}', b"{}")))
    return b"".join(draw(st.lists(st.sampled_from(_ODD_BYTES), max_size=12)))


#: Lines where the engine's CSV reader ends a line at a carriage return that Python reads on past: the file's one
#: line (no newline in it), or a carriage return with only whitespace on one side of it.
_CR_LINES = [
    (b"{\rx", b""),
    (b'{\r"llmtap_record": 2', b""),
    (b"\r{", b""),
    (b"{\r{", b""),
    (b"{\r ", b"\n"),
    (b"{\r\t", b"\r\n"),
    (b" \r{", b""),
    (b' \r{"llmtap_record":', b"\n"),
    (b"\t\r{", b"\n"),
]


@pytest.mark.parametrize(("line", "end"), _CR_LINES)
def test_a_line_with_a_carriage_return_is_of_one_kind_in_either_engine(line: bytes, end: bytes, tmp_path: Path) -> None:
    """A carriage return in a line never makes two lines of it: the kind (``truncated`` when its JSON, without
    the whitespace around it, starts with the record key or is cut short within it, else ``foreign``) and the
    count are the same whichever engine reads it."""
    (tmp_path / "m.jsonl").write_bytes(b"\n" + line + end if line.startswith(b" ") else line + end)
    (tmp_path / "good.jsonl").write_bytes(lines(make(5, seed=11)))
    own = line.strip(b" \t\r")
    want = "truncated" if b'{"llmtap_record":'.startswith(own) else "foreign"
    for engine in store.ENGINES:
        scan = _scan(engine, tmp_path)
        assert (scan.records, scan.skipped) == (5, {want: 1}), engine


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.lists(_line(), min_size=1, max_size=30), gz=st.booleans(), end=st.sampled_from((b"\n", b"\r\n", b"")))
@example(body=[b"{\rx"], gz=False, end=b"")
@example(body=[b"{\r "], gz=True, end=b"\n")
@example(body=[b"[1]", b" \r{"], gz=False, end=b"")
def test_any_mix_of_lines_reads_the_same_in_either_engine(
    body: list[bytes], gz: bool, end: bytes, tmp_path: Path
) -> None:
    """Lines of every kind, plain or compressed, with or without a last newline: the same records, figures and
    counts whichever engine reads them (the engine's CSV reader meets a stray carriage return or delimiter and
    hands the file to Python's reader)."""
    data = b"\n".join(body) + end
    # The one known difference: DuckDB's CSV reader ends a line at a carriage return that follows the first byte
    # of its delimiter (engine_sql.DELIMITER); Python reads one line there (a line damage all but never makes).
    assume(b"\x01\r" not in data)
    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example: hypothesis runs several in one test
    (folder / ("m.jsonl.gz" if gz else "m.jsonl")).write_bytes(gzip.compress(data) if gz else data)
    (folder / "good.jsonl").write_bytes(lines(make(5, seed=11)))
    a, b = (_scan(engine, folder) for engine in store.ENGINES)
    assert (a.records, a.skipped, _facts(a)) == (b.records, b.skipped, _facts(b))
    assert a.records >= 5


@st.composite
def _time_text(draw: st.DrawFn) -> str:
    """A record's ``time`` as writers spell it, well or badly: ISO 8601's extended and basic forms, week dates,
    a space or ``t`` for ``T``, hours to 24, seconds to 60, fractions of any length with a dot or a comma, zones as
    ``Z``/``z``, ``+HH``, ``+HHMM``, ``+HH:MM`` or a name, whitespace around, and any one character changed."""
    well = draw(st.integers(0, 3)) > 0  # most values well formed, so both engines' readings are compared often
    year = draw(st.sampled_from(("2026", "1999", "0001", "9999") if well else ("0000", "20261", "2026")))
    month = draw(st.integers(1, 12) if well else st.integers(0, 13))
    day = draw(st.integers(1, 28) if well else st.integers(0, 32))
    hour = draw(st.integers(0, 23) if well else st.integers(0, 25))
    minute, second = (draw(st.integers(0, 59) if well else st.integers(0, 61)) for _ in range(2))
    date = f"{year}-{month:02d}-{day:02d}"
    if not well:
        date = draw(st.sampled_from((date, f"{year}{month:02d}{day:02d}", f"{year}-W49-1", f"{year}-{month:02d}")))
    clocks = ["", f"{hour:02d}:{minute:02d}", f"{hour:02d}:{minute:02d}:{second:02d}"]
    clock = draw(st.sampled_from(clocks + ([f"{hour:02d}", f"{hour:02d}{minute:02d}"] if not well else [])))
    if clock.count(":") == 2 and draw(st.booleans()):
        comma = not well and draw(st.booleans())
        clock += ("," if comma else ".") + draw(st.text("0123456789", min_size=0 if not well else 1, max_size=10))
    zones = ["", "Z", "+00:00", "-05:30", "+0530", "+05", "-00:00"]
    zone = draw(st.sampled_from(zones + ([] if well else ["z", "+24:00", " UTC", "+5:30"])))
    apart = draw(st.sampled_from(("T", " ") if well else ("T", " ", "t")))
    text = date + (apart + clock + zone if clock else zone * (not well and draw(st.booleans())))
    if not well and draw(st.booleans()):
        at = draw(st.integers(0, len(text) - 1))
        text = text[:at] + draw(st.sampled_from("0 9:-+.TZ\t\u00a0x")) + text[at + 1 :]
    pad = draw(st.sampled_from(("", " ", "\t", "\r", "\n", "\u00a0", "\u2003")))
    return draw(st.sampled_from((pad + text, text + pad)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_time_text())
@example(text="2026-12-07T24:00:00+00:00")
@example(text="20261207T100000Z")
@example(text="2026-12-07T10:00:00 UTC")
@example(text="2026-12-07T10:00:00,5+00:00")
@example(text="2026-12-07T10:00:00\u00a0")
@example(text="0000-01-01T00:00:00+00:00")
@example(text="0001-01-01T00:00:00.000004")
def test_any_time_is_read_alike_or_counted_alike_in_either_engine(text: str, tmp_path: Path) -> None:
    """A record's ``time`` is one grammar (``store.TIME_GRAMMAR``) whichever engine reads it: both read the same
    records at the same moment, or both count them as without a readable time."""
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    recs = make(3, seed=17)
    for rec in recs:
        rec["time"] = text
    (folder / "t.jsonl").write_bytes(lines(recs))
    a, b = (_scan(engine, folder) for engine in store.ENGINES)
    assert (a.records, a.skipped) == (b.records, b.skipped)
    groups = [sorted(s.groups, key=lambda g: (g.key or "", g.route or "", g.shape or "")) for s in (a, b)]
    assert [(g.key, g.route, g.shape) for g in groups[0]] == [(g.key, g.route, g.shape) for g in groups[1]]
    moments = [[t for g in gs for t in (g.first, g.last)] for gs in groups]
    # The same microsecond; as epoch seconds in a float, a unit in the last place apart where the engines' arithmetic
    # differs (7.6 µs at year 1).
    assert moments[0] == pytest.approx(moments[1], rel=1e-15, abs=1e-6)
