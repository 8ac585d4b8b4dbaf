"""``llmtap docs``: the documentation reachable from the command, in a checkout and from the built wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from llmtap.commands import manual
from llmtap.config.types import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_the_list_names_every_page_with_its_title() -> None:
    listing = manual.read(None)
    for page in (ROOT / "docs").glob("*.md"):
        assert page.stem in listing, page.name
    assert "Settings of `llmtap serve`" in listing


def test_a_page_prints_whole_and_an_unknown_one_names_the_pages() -> None:
    assert manual.read("settings") == (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert manual.read("settings.md") == manual.read("settings")
    with pytest.raises(ConfigError, match=r"no page 'nope'; pages: .*settings"):
        manual.read("nope")


def test_the_command_prints_a_page_and_exits_2_on_an_unknown_one() -> None:
    ok = subprocess.run([sys.executable, "-m", "llmtap", "docs", "recipes"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("# Recipes")
    bad = subprocess.run([sys.executable, "-m", "llmtap", "docs", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no page 'nope'" in bad.stderr


def test_the_wheel_carries_the_docs_and_the_command_finds_them(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("llmtap-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert "llmtap/_docs/settings.md" in names and "llmtap/_docs/record.schema.json" in names
        assert not [n for n in names if n.startswith("llmtap/_docs/generate/")], "the generators stay out of the wheel"
        assert not [n for n in names if n.startswith("proxy/")], "the import name is llmtap"
        z.extractall(site)
    # The extracted wheel alone on the path (not the checkout): the command reads the packaged copy.
    code = (
        "import sys; from llmtap.commands import manual; "
        "print(manual.folder()); sys.stdout.write(manual.read('settings'))"
    )
    shown = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    where, _, text = shown.stdout.partition("\n")
    assert Path(where) == site / "llmtap" / "_docs"
    assert text == (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
