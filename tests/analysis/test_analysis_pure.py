"""``llmtap.analysis`` stays pure: functions over finished requests and records, no command parts.

Its modules import no argument parser, no HTTP client, no plotting and no record source (``llmtap.store``),
and nothing of the command layer or of either process; they print nothing and open no file of their own.
The commands (``llmtap.commands``) read, query, print and draw.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from llmtap import store
from llmtap.analysis import compare

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "proxy" / "llmtap"
ANALYSIS = PACKAGE / "analysis"

#: What an analysis module never loads, directly or through what it imports.
FORBIDDEN = (
    "argparse",
    "httpx",
    "matplotlib",
    "duckdb",
    "urllib.request",
    "opentelemetry",
    "starlette",
    "uvicorn",
    "llmtap.store",
    "llmtap.commands",
    "llmtap.cli",
    "llmtap.relay",
    "llmtap.telemetry",
    "llmtap.simulator",
)

#: The files analysis reads: the tokenizer's tables, the package's own data, read once (the price tables are
#: read by ``llmtap.config.prices``).
READS_FILES = {("tokens.py", "get_encoding")}


def _modules() -> list[str]:
    return sorted(p.stem for p in ANALYSIS.glob("*.py") if p.stem != "__init__")


def test_analysis_modules_load_no_command_http_plot_or_store_module() -> None:
    # The package root (``llmtap/__init__.py``) exports the relay's app, which loads httpx: the check loads the
    # analysis modules under a bare package, so it sees what they load themselves.
    code = (
        "import importlib, sys, types\n"
        f"pkg = types.ModuleType('llmtap'); pkg.__path__ = [{str(PACKAGE)!r}]; sys.modules['llmtap'] = pkg\n"
        f"for name in {_modules()!r}:\n"
        "    importlib.import_module('llmtap.analysis.' + name)\n"
        f"forbidden = {FORBIDDEN!r}\n"
        "print(sorted(m for m in sys.modules if m.startswith(forbidden)))\n"
        "print(len([m for m in sys.modules if m.startswith('llmtap.analysis.')]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded, count = done.stdout.splitlines()
    assert loaded == "[]", loaded
    assert int(count) == len(_modules()) > 10


def _calls(tree: ast.AST) -> list[tuple[str, int]]:
    """The names of every function called (``print``, ``read_text``) and every ``sys.stdout``-like attribute."""
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            out.append((name, node.lineno))
        elif isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr", "stdin"):
            out.append((node.attr, node.lineno))
    return out


def _enclosing(tree: ast.Module, line: int) -> str:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.lineno <= line <= (node.end_lineno or line):
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef) and sub.lineno <= line <= (sub.end_lineno or line):
                        return sub.name
            return node.name
    return "<module>"


def test_analysis_prints_nothing_and_reads_no_file_of_its_own() -> None:
    io = {"print", "input", "open", "read_text", "read_bytes", "write_text", "write_bytes", "stdout", "stderr"}
    io |= {"stdin", "savefig", "urlopen"}
    found: set[tuple[str, str]] = set()
    imports: dict[str, list[str]] = {}
    for path in sorted(ANALYSIS.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name, line in _calls(tree):
            if name in io:
                found.add((path.name, _enclosing(tree, line)))
        # Imports anywhere, in functions too (a lazy import still runs when called); under TYPE_CHECKING, none.
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _type_checking(node):
                node.body = []
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            bad = [n for n in names if n.startswith(FORBIDDEN)]
            if bad:
                imports.setdefault(path.name, []).extend(bad)
    assert imports == {}, imports
    assert found == READS_FILES, found ^ READS_FILES


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def test_a_side_names_no_more_slow_requests_than_each_group_keeps() -> None:
    """The comparison's slowest requests are drawn from each group's; a group keeps ``store.SLOWEST``."""
    assert compare.SLOWEST <= store.SLOWEST
