"""A release a stranger can install: ``python -m build`` makes a wheel and an sdist that ``twine check`` passes, each
carrying what the package needs and nothing else, and each, installed alone in a clean virtual environment (its
dependencies from the package index, nothing from this checkout), runs ``llmtap demo`` and ``llmtap --version``.

Real tier: it needs ``build`` and ``twine`` (the test extra) and the package index. The two installs and demos run
side by side (each mostly waits on the index and the simulator's clock); the module takes about two minutes.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.conftest import require_real

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a build, an install or a demo may take before the test says which one hung.
STEP_TIMEOUT = 600

pytestmark = pytest.mark.real
#: A duration as the demo prints it: ``785 ms``, ``1.05 s``.
DURATION = r"\d+(?:\.\d+)? m?s"


def version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        found = tomllib.load(f)["project"]["version"]
    assert isinstance(found, str)
    return found


def seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) / (1000 if unit == "ms" else 1)


def tracked(*paths: str) -> set[str]:
    """The files git tracks under ``paths`` (the checkout's own, never what a run left beside them)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--", *paths], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, f"the release checks compare with git's files: {listed.stderr}"
    return {name for name in listed.stdout.split("\0") if name}


def stranger_env(home: Path) -> dict[str, str]:
    """The environment of someone who installed llmtap and nothing else: none of this checkout's Python paths, no
    llmtap or OpenTelemetry settings, temporary files and tiktoken's cache in places of their own (the cache empty,
    so token counting must use the encodings the package carries)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONSAFEPATH")
        and not k.startswith(("LLMTAP_", "OTEL_", "TIKTOKEN_"))
    }
    for name in ("tmp", "tiktoken"):
        (home / name).mkdir(exist_ok=True)
    env.update(TMPDIR=str(home / "tmp"), TIKTOKEN_CACHE_DIR=str(home / "tiktoken"))
    return env


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=STEP_TIMEOUT, cwd=cwd, env=env)
    said = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{said}"
    return done


@dataclass(frozen=True)
class Installed:
    """One artifact installed alone in a fresh virtual environment, and what its commands printed there."""

    artifact: Path
    venv: Path
    module_file: str
    version_line: str
    docs: str
    demo: subprocess.CompletedProcess[str]


def install_and_run(artifact: Path, home: Path) -> Installed:
    """A clean venv (no system site-packages), ``pip install ARTIFACT`` from a folder of its own, then the commands."""
    home.mkdir()
    env = stranger_env(home)
    venv = home / "venv"
    run([sys.executable, "-m", "venv", str(venv)], home, env)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    # --no-compile: the same files, without byte-compiling every dependency up front (seconds of CPU per install).
    run([str(python), "-m", "pip", "install", "--quiet", "--no-compile", str(artifact)], home, env)
    run([str(python), "-m", "pip", "check"], home, env)
    where = run([str(python), "-c", "import llmtap; print(llmtap.__file__)"], home, env).stdout.strip()
    shown = run([str(bin_dir / "llmtap"), "--version"], home, env).stdout.strip()
    docs = run([str(bin_dir / "llmtap"), "docs"], home, env).stdout
    demo = run([str(bin_dir / "llmtap"), "demo"], home, env)
    return Installed(artifact, venv, where, shown, docs, demo)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and the sdist, built as a release builds them: ``python -m build`` (isolated), then twine's check."""
    require_real(
        find_spec("build") is not None and find_spec("twine") is not None,
        "build and twine",
        "pip install -e '.[test]'",
    )
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], out)
    run([sys.executable, "-m", "twine", "check", "--strict", *map(str, sorted(out.iterdir()))], out)
    return out


@pytest.fixture(scope="module")
def installed(
    dist: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, concurrent.futures.Future[Installed]]]:
    """Each artifact installed and run, the two side by side; each test waits for its own (one failing install
    does not hide how the other went)."""
    base = tmp_path_factory.mktemp("installs")
    artifacts = {"wheel": wheel_of(dist), "sdist": sdist_of(dist)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        yield {kind: pool.submit(install_and_run, path, base / kind) for kind, path in artifacts.items()}


def wheel_of(dist: Path) -> Path:
    (wheel,) = dist.glob("*.whl")
    assert wheel.name == f"llmtap-{version()}-py3-none-any.whl"
    return wheel


def sdist_of(dist: Path) -> Path:
    (sdist,) = dist.glob("*.tar.gz")
    assert sdist.name == f"llmtap-{version()}.tar.gz"
    return sdist


def test_build_makes_exactly_a_wheel_and_an_sdist_of_this_version(dist: Path) -> None:
    assert sorted(p.name for p in dist.iterdir()) == sorted([wheel_of(dist).name, sdist_of(dist).name])


def test_the_wheel_carries_the_package_its_docs_and_licence_and_nothing_else(dist: Path) -> None:
    info = f"llmtap-{version()}.dist-info"
    with zipfile.ZipFile(wheel_of(dist)) as z:
        names = set(z.namelist())
        metadata = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    package = {"llmtap/" + n.removeprefix("proxy/llmtap/") for n in tracked("proxy/llmtap")}
    docs = {"llmtap/_docs/" + n.removeprefix("docs/") for n in tracked("docs") if not n.startswith("docs/generate/")}
    # Every file of the package as git has it (code, the tiktoken encodings, prices, the live view's assets,
    # py.typed), the documentation `llmtap docs` reads, the licence: and not one file more.
    assert {n for n in names if not n.startswith(info)} == package | docs
    assert {"llmtap/data/o200k_base.tiktoken", "llmtap/data/cl100k_base.tiktoken", "llmtap/py.typed"} <= package
    assert f"{info}/licenses/LICENSE" in names
    assert re.search(rf"^Version: {re.escape(version())}$", metadata, re.M)
    assert re.search(r"^License-Expression: Apache-2.0$", metadata, re.M)
    assert "llmtap = llmtap.cli:main" in entry_points


def test_the_sdist_carries_the_source_and_nothing_untracked(dist: Path) -> None:
    top = f"llmtap-{version()}/"
    with tarfile.open(sdist_of(dist)) as t:
        names = {m.name.removeprefix(top) for m in t.getmembers() if m.isfile()}
    expected = tracked("proxy/llmtap", "docs") | {"README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml"}
    # What a build of the sdist needs and what its readers look for; PKG-INFO is made by the build itself.
    assert names - {"PKG-INFO"} <= tracked() and expected <= names
    # No tests, benchmarks, tools or caches: nothing of a run (.tools, __pycache__, .venv) rides along.
    assert not [n for n in names if n.startswith(("tests/", "bench/", ".tools/", ".ci/", "helm/", "collectors/"))]
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installed_alone_the_command_says_its_version_and_finds_its_docs(
    installed: dict[str, concurrent.futures.Future[Installed]], kind: str
) -> None:
    got = installed[kind].result()
    # The package came from the artifact into the venv, not from this checkout.
    assert Path(got.module_file).is_relative_to(got.venv), got.module_file
    assert not Path(got.module_file).is_relative_to(ROOT)
    # Installed, the version is the distribution's metadata (no pyproject.toml beside the package).
    assert got.version_line == f"llmtap {version()}"
    for page in tracked("docs"):
        if page.endswith(".md") and not page.startswith("docs/generate/"):
            assert Path(page).stem in got.docs, page


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installed_alone_llmtap_demo_measures_both_workloads_and_finds_the_caching_gain(
    installed: dict[str, concurrent.futures.Future[Installed]], kind: str
) -> None:
    demo = installed[kind].result().demo
    out = demo.stdout
    progress = demo.stderr
    for workload in ("support assistant", "code completion"):
        for layout in ("variable-first", "fixed-first"):
            done = re.search(rf"^{workload}, {layout}: (\d+)/(\d+) done in ", progress, re.M)
            assert done and done[1] == done[2] and int(done[1]) > 0, progress
            # The phase's row: TTFT p50 and p95 measured (``785 ms``, ``1.05 s``).
            assert re.search(rf"^  {layout} +{DURATION} +{DURATION} ", out, re.M), out
        assert re.search(rf"^{workload}: \S", out, re.M), f"no verdict for {workload}:\n{out}"
    # The support assistant's prompt moves 5,250 of 6,200 tokens into the cached prefix: a gain too large for any
    # load on the machine to hide (the code completion's, a tenth of it, is only required to have a verdict).
    gain = re.search(rf"^support assistant: caching gain: TTFT p50 ({DURATION}) to ({DURATION}) ", out, re.M)
    assert gain and seconds(gain[2]) < seconds(gain[1]), out
    # The request records and the telemetry files it names are there, and hold what it measured.
    records = re.search(r"^Request records: (\S+)$", out, re.M)
    assert records and any(p.is_file() and p.stat().st_size for p in Path(records[1]).rglob("*")), out
    traces = re.search(r"^  (\S+/traces\.jsonl)$", out, re.M)
    assert traces, out
    spans = [json.loads(line) for line in Path(traces[1]).read_text(encoding="utf-8").splitlines()]
    assert [s for s in spans if str(s.get("name", "")).startswith("chat ")], "no request span among the traces"
    assert "Traceback" not in progress + out
