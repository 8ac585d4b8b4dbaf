"""The reference docs: generated from the code, current, complete, and linked from the README."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmtap.analysis import compare
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.exposition.prometheus import metric_name
from tests.support.generators import load

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference.md"
docs = load("reference")


def test_reference_is_current() -> None:
    # What CI runs: the file in the repository is exactly what the code generates now.
    run = subprocess.run(
        [sys.executable, "docs/generate/reference.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_check_fails_when_stale(tmp_path: Path) -> None:
    stale = tmp_path / "reference.md"
    stale.write_text(REFERENCE.read_text(encoding="utf-8").replace("Request received", "Request sent", 1))
    said: list[str] = []
    assert docs.main(["--check", "--out", str(stale)], write=said.append) == 1
    assert "stale" in said[0]
    assert docs.main(["--out", str(stale)], write=said.append) == 0
    assert docs.main(["--check", "--out", str(stale)], write=said.append) == 0


def test_every_metric_and_attribute_is_in_the_reference() -> None:
    text = REFERENCE.read_text(encoding="utf-8")
    for latest in (False, True):
        for ins in docs.instruments(latest=latest):
            if ins.name in docs.RENAMED.values():
                assert f"`{ins.name}`" in text, ins.name  # named beside the released name
                continue
            assert f"### {ins.name}\n" in text, ins.name
            assert f"`{metric_name(ins.name, ins.unit, counter=ins.kind == 'counter')}`" in text, ins.name
    for name in docs.declared_attributes():
        assert re.search(rf"^\| `{re.escape(name)}` \|", text, re.MULTILINE), name
    for span in (sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_CHUNK):
        assert f"### `{span}`" in text, span


def test_a_name_without_a_definition_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(docs.ATTRIBUTES, sc.CACHE_CLASS)
    with pytest.raises(SystemExit, match=re.escape(sc.CACHE_CLASS)):
        docs.generate()
    monkeypatch.undo()
    monkeypatch.delitem(docs.METRICS, sc.METRIC_REQUESTS)
    with pytest.raises(SystemExit, match=re.escape(sc.METRIC_REQUESTS)):
        docs.generate()


def test_a_wrong_type_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(docs.ATTRIBUTES, sc.SERVER_PORT, ("string", "The upstream's port."))
    with pytest.raises(SystemExit, match=re.escape("server.port is declared string but emitted as int")):
        docs.generate()


def test_hand_written_docs_are_linked_and_their_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/" in readme
    for name in (
        "reference.md",
        "reading-the-numbers.md",
        "recipes.md",
        "reference-comparison.md",
        "memory.md",
        "performance.md",
    ):
        page = ROOT / "docs" / name
        assert page.stat().st_size > 2000, name
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).resolve().exists(), f"{name} links to missing {target}"


def test_the_verdicts_thresholds_in_the_docs_are_the_codes() -> None:
    text = (ROOT / "docs" / "reading-the-numbers.md").read_text(encoding="utf-8")
    gain = re.search(r"at\s+least\s+(\d+)%\s+of\s+the\s+before\s+side's\s+TTFT\s+p50\s+\(`--min-gain-share`", text)
    rise = re.search(r"cached share to rise\s+\(by (\d+) points or more\)", text)
    fewer = re.search(r"fewer than (\d+) requests a side there is no verdict", text)
    assert gain and rise and fewer, "reading-the-numbers.md no longer states the verdict's thresholds"
    assert int(gain.group(1)) / 100 == compare.MIN_GAIN_SHARE
    assert int(rise.group(1)) / 100 == compare.CACHED_SHARE_RISE
    assert int(fewer.group(1)) == compare.MIN_REQUESTS
