"""The layout holds what it promises: the relay process loads no OpenTelemetry and no tokenizer, and the
layer contracts in pyproject.toml (``lint-imports``) are kept, and would catch an import that breaks one."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _loaded(imports: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules of ``prefixes`` a fresh interpreter has loaded after ``imports``."""
    code = f"import sys\n{imports}\nprint(sorted(m for m in sys.modules if m.startswith({prefixes!r})))\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return list(ast.literal_eval(done.stdout.strip()))


def test_the_relay_process_imports_no_opentelemetry_and_no_tokenizer() -> None:
    # ``llmtap serve`` with one relay: the parent runs the relay and starts the telemetry processes.
    parent = "import llmtap.cli, llmtap.serve.run, llmtap.serve.workers\nfrom llmtap.relay.app import create_app"
    assert _loaded(parent, ("opentelemetry", "tiktoken")) == []
    # A relay process of ``--workers`` loads nothing of the telemetry side or analysis at all.
    worker = "import llmtap.serve.relay"
    assert _loaded(worker, ("opentelemetry", "tiktoken", "llmtap.telemetry", "llmtap.analysis")) == []
    # The check sees what it looks for: the in-process assembly loads both.
    local = _loaded("import llmtap.serve.local", ("opentelemetry.sdk", "tiktoken", "llmtap.telemetry.recorder"))
    assert "llmtap.telemetry.recorder" in local and "tiktoken" in local


def _lint_imports(cwd: Path, package_parent: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the contracts of ``cwd/pyproject.toml``, over the package found in ``package_parent``."""
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[test]'")
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([exe, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_are_kept() -> None:
    done = _lint_imports(ROOT, ROOT / "proxy")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_a_relay_module_that_imports_the_telemetry_side_breaks_the_contracts(tmp_path: Path) -> None:
    """The contracts can fail: the same contracts over a copy of the package whose relay imports the recorder."""
    copy = tmp_path / "proxy"
    shutil.copytree(ROOT / "proxy" / "llmtap", copy / "llmtap", ignore=shutil.ignore_patterns("__pycache__", "data"))
    guard = copy / "llmtap" / "relay" / "guard.py"
    guard.write_text(guard.read_text(encoding="utf-8") + "\nfrom llmtap.telemetry import recorder as _recorder\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    done = _lint_imports(tmp_path, copy)
    assert done.returncode != 0, done.stdout
    # Each contract that guards the relay names the import; the untouched tree keeps them all (above).
    assert "llmtap.relay.guard -> llmtap.telemetry.recorder" in done.stdout
    assert "Contracts: 3 kept, 4 broken." in done.stdout, done.stdout  # telemetry-rooms, analysis-pure, acyclic kept


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT / "proxy").with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _taken(files: list[Path], modules: set[str]) -> dict[str, set[str]]:
    """The public names each of ``modules`` gives to the others: ``from m import name``, and ``m.name`` where a
    file imported the module ``m`` under a name of its own."""
    taken: dict[str, set[str]] = {m: set() for m in modules}
    for path in files:
        me = _module_name(path) if path.is_relative_to(ROOT / "proxy") else None
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in modules and node.level == 0:
                for a in node.names:
                    if f"{node.module}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif node.module != me and not a.name.startswith("_"):
                        taken[node.module].add(a.name)
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                module = aliases[node.value.id]
                if module != me and not node.attr.startswith("_"):
                    taken[module].add(node.attr)
    return taken


def _declared(path: Path) -> set[str] | None:
    """A module's ``__all__`` (None: it has none)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def test_every_name_another_module_takes_is_in_its_modules_all() -> None:
    """A module others import from says what it offers (``__all__``), and says every name they take from it."""
    package = ROOT / "proxy" / "llmtap"
    paths = {_module_name(p): p for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    files = [
        p
        for d in ("proxy", "tests", "bench", "docs", "dashboards")
        for p in (ROOT / d).rglob("*.py")
        if "__pycache__" not in p.parts
    ]
    taken = _taken(files, set(paths))
    assert len([m for m, names in taken.items() if names]) > 50  # the walk sees the package's imports
    missing = {}
    for module, names in taken.items():
        path = paths[module]
        if path.name == "__init__.py":  # a package's submodules are reached through it, not offered by it
            names = {n for n in names if f"{module}.{n}" not in paths}
        if not names:
            continue
        declared = _declared(path)
        if declared is None or not names <= declared:
            missing[module] = sorted(names - (declared or set()))
    assert missing == {}, missing


def _bench_imports(source: str) -> list[str]:
    """The imports of ``bench`` or a module under it in ``source``, as written (at any depth: a function's too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [f"{n} (line {node.lineno})" for n in names if n == "bench" or n.startswith("bench.")]
    return found


def test_the_tests_import_nothing_from_the_benchmark() -> None:
    """The benchmark builds on the tests' support package (``tests.support``), never the other way: a test that
    needed the benchmark's code would tie the suite to whatever the benchmark measures next."""
    assert _bench_imports("import os\nfrom bench.procs import Sampler\ndef f():\n    import bench.run\n") == [
        "bench.procs (line 2)",
        "bench.run (line 4)",
    ]
    assert _bench_imports("from benchmarks import x\nfrom tests.support.net import free_port\n") == []
    files = [p for p in (ROOT / "tests").rglob("*.py") if "__pycache__" not in p.parts]
    assert len(files) > 80 and ROOT / "tests" / "support" / "net.py" in files
    found = {str(p.relative_to(ROOT)): _bench_imports(p.read_text(encoding="utf-8")) for p in files}
    assert {path: names for path, names in found.items() if names} == {}
