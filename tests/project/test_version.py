"""One version string: pyproject.toml's ``version`` is the package's, ``llmtap --version``'s, the chart's appVersion
and the default image tag; and CHANGELOG.md has a dated entry for it (Keep a Changelog 1.1.0).

The image's tag comes from the same file (the image build reads pyproject.toml); the wheel's and the sdist's
metadata are checked where they are built and installed (``tests/deploy/test_release.py``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from helm_python.chart import Chart

import llmtap

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "llmtap"
#: A release heading: ``## [0.2.0] - 2026-12-07`` (Keep a Changelog 1.1.0).
RELEASE = re.compile(r"^## \[(?P<version>\d+\.\d+\.\d+)\] - (?P<date>\d{4}-\d{2}-\d{2})$")
#: The kinds of change Keep a Changelog names, each at most once per release.
KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")


def project_version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert isinstance(version, str)
    return version


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_package_and_the_command_say_pyprojects_version() -> None:
    version = project_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), "a release version, as the chart and the changelog write it"
    assert llmtap.__version__ == version
    shown = subprocess.run(
        [sys.executable, "-m", "llmtap", "--version"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"llmtap {version}"


def test_the_charts_app_version_and_default_image_tag_are_pyprojects() -> None:
    version = project_version()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert chart["appVersion"] == version
    assert re.fullmatch(r"\d+\.\d+\.\d+", str(chart["version"])), "the chart's own version is a release too"
    assert release(str(chart["version"])) >= release(version), "a chart older than the llmtap it ships"
    rendered = Chart.load(str(CHART)).render({}, name="rel", namespace="llm", is_install=True)
    docs = [d for name, text in rendered.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (proxy,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "llmtap"]
    assert proxy["image"].rsplit(":", 1)[1] == version, "the default image tag is the chart's appVersion"
    assert deployment["metadata"]["labels"]["app.kubernetes.io/version"] == version


def test_the_version_has_a_dated_changelog_entry_below_unreleased() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## [Unreleased]", "the next release's changes gather on top"
    releases = [RELEASE.match(h) for h in headings[1:]]
    assert all(releases), [h for h, m in zip(headings[1:], releases, strict=True) if m is None]
    versions = [m["version"] for m in releases if m]
    dates = [datetime.date.fromisoformat(m["date"]) for m in releases if m]
    assert project_version() in versions, f"CHANGELOG.md has no `## [{project_version()}] - YYYY-MM-DD` entry"
    assert versions == sorted(versions, key=release, reverse=True) and len(set(versions)) == len(versions)
    assert dates == sorted(dates, reverse=True)


def test_each_release_in_the_changelog_groups_its_changes_once_by_kind() -> None:
    sections = re.split(r"^## ", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), flags=re.M)[1:]
    for section in sections:
        title, _, body = section.partition("\n")
        kinds = re.findall(r"^### (.*)$", body, flags=re.M)
        assert set(kinds) <= set(KINDS), (title, kinds)
        assert len(kinds) == len(set(kinds)), f"{title}: a kind of change named twice: {kinds}"
        if title != "[Unreleased]":
            assert kinds, f"{title}: a release without changes"
            for kind in kinds:
                entries = body.split(f"### {kind}\n", 1)[1].split("\n### ", 1)[0]
                assert entries.lstrip().startswith("- "), (title, kind)


def test_installed_without_a_checkout_the_version_is_the_metadatas(tmp_path: Path) -> None:
    """A package installed by ``pip --target`` two folders below another project reads its metadata, not that
    project's pyproject.toml; under llmtap's own pyproject.toml (a checkout) it reads that file."""
    expected: str | None
    try:
        expected = importlib.metadata.version("llmtap")
    except importlib.metadata.PackageNotFoundError:
        expected = None
    init = Path(llmtap.__file__)
    for name, version, want in (("other", "9.9.9", expected or "0+unknown"), ("llmtap", "7.7.7", "7.7.7")):
        root = tmp_path / name
        (root / "target" / "llmtap").mkdir(parents=True)
        shutil.copy(init, root / "target" / "llmtap" / "__init__.py")
        (root / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "{version}"\n', encoding="utf-8")
        code = f"import sys; sys.path.insert(0, {str(root / 'target')!r}); import llmtap; print(llmtap.__version__)"
        shown = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.strip() == want, name


@pytest.mark.parametrize("name", ["nope", "version"])
def test_an_unknown_name_is_an_attribute_error(name: str) -> None:
    with pytest.raises(AttributeError, match=name):
        getattr(llmtap, name)
