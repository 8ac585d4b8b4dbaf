"""A copy of a checkout with its hot modules compiled by mypyc: ``python -m bench.probes.compiled``.

The package is typed throughout (``mypy --strict``), so mypyc can compile its modules to C extensions as they are.
What that buys is measured against the same code interpreted: this copies a checkout's ``proxy/`` (``--tree``,
default this one) into ``--out``, compiles the modules named (``--module``, repeatable; default ``HOT``, the
relay's and the telemetry's per-request path as the short-request profile names it, docs/performance.md) with
mypyc there, and checks that each compiled module is what Python imports from that copy (its extension, not its
source). A module mypyc refuses (a construct it does not compile, e.g. a class that inherits from a builtin
other than ``object``/``Exception``) is left interpreted and reported with mypyc's words; the others are compiled
again without it. Prints one JSON line: what compiled, what was refused and why, the seconds it took.

The copy is a tree as the side-by-side probes take one::

    python -m bench.probes.compiled --out /tmp/llmtap-compiled
    git archive HEAD proxy | tar -x -C /tmp/llmtap-pure
    python -m bench.probes.rps_ab --base /tmp/llmtap-pure --new /tmp/llmtap-compiled
    python -m bench.probes.relay_cpu --tree /tmp/llmtap-pure --tree /tmp/llmtap-compiled --summary
    PYTHONPATH=/tmp/llmtap-compiled/proxy:. python -m bench.probes.telemetry
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import peers

#: The per-request path, both processes: the relay's exchange, pipe, upstream client, heads and tape; the
#: provider decoders; the telemetry's intake, replay, summary, spans and metrics.
HOT = (
    "llmtap.listener",
    "llmtap.relay.exchange",
    "llmtap.relay.pipe",
    "llmtap.relay.heads",
    "llmtap.relay.forward",
    "llmtap.relay.guard",
    "llmtap.relay.admission",
    "llmtap.relay.handover",
    "llmtap.relay.channel",
    "llmtap.relay.shared",
    "llmtap.relay.timing",
    "llmtap.relay.watch",
    "llmtap.relay.bodyread",
    "llmtap.relay.frame",
    "llmtap.relay.upstream.connection",
    "llmtap.relay.upstream.http11",
    "llmtap.relay.upstream.pool",
    "llmtap.relay.upstream.transport",
    "llmtap.relay.upstream.body",
    "llmtap.wire.tape",
    "llmtap.wire.framing",
    "llmtap.wire.messages",
    "llmtap.wire.socketchannel",
    "llmtap.wire.tracecontext",
    "llmtap.providers",
    "llmtap.providers.base",
    "llmtap.providers.sse",
    "llmtap.providers.openai_common",
    "llmtap.providers.openai_chat",
    "llmtap.providers.embeddings",
    "llmtap.telemetry.intake.inbox",
    "llmtap.telemetry.intake.replay",
    "llmtap.telemetry.recorder",
    "llmtap.telemetry.loop",
    "llmtap.telemetry.emit.metrics",
    "llmtap.telemetry.emit.bulk",
    "llmtap.telemetry.emit.spans",
    "llmtap.telemetry.emit.attributes",
    "llmtap.analysis.summary",
    "llmtap.analysis.timeline",
)

#: mypyc's (mypy's) error lines: ``path:line: error: message``.
_ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):(?P<line>\d+):(?:\d+:)? error: (?P<message>.*)$")


def source(proxy: Path, module: str) -> Path:
    """The file of ``module`` under ``proxy`` (a package is its ``__init__.py``)."""
    base = proxy.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def module_of(path: str) -> str:
    """The module a path relative to ``proxy/`` names."""
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def copy_tree(tree: Path, out: Path) -> Path:
    """``tree``'s ``proxy/`` into ``out`` (emptied first), without byte-code or earlier builds; its mypy settings
    beside it (``out/pyproject.toml``). The copy's ``proxy/``."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "build")
    shutil.copytree(tree / "proxy", out / "proxy", ignore=skip)
    shutil.copy2(tree / "pyproject.toml", out / "pyproject.toml")
    return out / "proxy"


def mypyc(proxy: Path, modules: list[str]) -> tuple[int, str]:
    """One mypyc build of ``modules`` in place under ``proxy``: its exit status and its output."""
    files = [str(source(proxy, m).relative_to(proxy)) for m in modules]
    env = {**os.environ, "MYPYPATH": str(proxy)}
    argv = [sys.executable, "-m", "mypyc", "--config-file", str(proxy.parent / "pyproject.toml"), *files]
    done = subprocess.run(argv, cwd=proxy, env=env, capture_output=True, text=True, check=False)
    return done.returncode, done.stdout + done.stderr


def refusals(output: str, modules: list[str]) -> dict[str, str]:
    """The modules among ``modules`` that mypyc's ``output`` names in an error, with its first words on each."""
    found: dict[str, str] = {}
    for line in output.splitlines():
        got = _ERROR.match(line.strip())
        if got is None:
            continue
        module = module_of(got["path"])
        if module in modules and module not in found:
            found[module] = f"line {got['line']}: {got['message']}"
    return found


def _base_name(base: ast.expr) -> str | None:
    """The class name a base expression names (``Name``, ``mod.Name``, ``Name[...]``)."""
    if isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Attribute):
        return base.attr
    return base.id if isinstance(base, ast.Name) else None


def subclassed(tree: Path, proxy: Path, modules: list[str]) -> dict[str, str]:
    """The modules among ``modules`` with a class that a module left interpreted (in ``proxy``, or the tree's
    tests) subclasses: a compiled class refuses interpreted subclasses, so these stay interpreted too."""
    defined: dict[str, str] = {}
    for module in modules:
        for node in ast.parse(source(proxy, module).read_text()).body:
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, module)
    found: dict[str, str] = {}
    for root in (proxy, tree / "tests"):
        for path in sorted(root.rglob("*.py")):
            here = module_of(str(path.relative_to(proxy))) if root == proxy else str(path.relative_to(tree))
            if here in modules:
                continue
            for cls in ast.walk(ast.parse(path.read_text())):
                for base in cls.bases if isinstance(cls, ast.ClassDef) else []:
                    name = _base_name(base)
                    if name in defined and defined[name] not in found:
                        found[defined[name]] = f"class {name} is subclassed by interpreted {here}"
    return found


def _attempt(proxy: Path, modules: list[str]) -> tuple[str, list[str]]:
    """One build: mypyc's output and the modules it was given (no output when it compiled them all); a
    failure that names none of them is an error."""
    status, output = mypyc(proxy, modules)
    if status == 0:
        return "", modules
    if not refusals(output, modules):
        raise RuntimeError(f"mypyc failed without naming a module:\n{output[-3000:]}")
    return output, modules


def build(tree: Path, proxy: Path, modules: list[str]) -> tuple[list[str], dict[str, str]]:
    """Compile ``modules``, leaving out each with a class interpreted code subclasses, then each that mypyc
    refuses, until the rest compile: (compiled, refused)."""
    left = list(modules)
    refused: dict[str, str] = {}
    while left:
        kept_out = subclassed(tree, proxy, left) or refusals(*_attempt(proxy, left))
        if not kept_out:
            break
        refused.update(kept_out)
        left = [m for m in left if m not in kept_out]
    shutil.rmtree(proxy / "build", ignore_errors=True)
    return left, refused


def imported_from(proxy: Path, modules: list[str]) -> dict[str, str]:
    """The file each module is imported from, in a fresh interpreter whose path starts at ``proxy``."""
    code = "import importlib, json, sys; "
    code += "print(json.dumps({m: importlib.import_module(m).__file__ for m in sys.argv[1:]}))"
    env = {**os.environ, "PYTHONPATH": str(proxy)}
    done = subprocess.run(
        [sys.executable, "-c", code, *modules], env=env, capture_output=True, text=True, check=True, cwd=proxy
    )
    files: dict[str, str] = json.loads(done.stdout)
    return files


def main(argv: list[str] | None = None) -> int:
    """Copy, compile, check the imports; print the outcome."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.compiled", description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, default=peers.REPO, help="the checkout to copy (default: this one)")
    p.add_argument("--out", type=Path, required=True, help="where the compiled copy goes (emptied first)")
    p.add_argument("--module", action="append", help="a module to compile (repeatable; default: the hot path)")
    args = p.parse_args(argv)
    started = time.monotonic()
    proxy = copy_tree(args.tree.resolve(), args.out.resolve())
    compiled, refused = build(args.tree.resolve(), proxy, list(args.module or HOT))
    files = imported_from(proxy, compiled)
    interpreted = sorted(m for m, f in files.items() if not f.endswith(".so"))
    print(
        json.dumps(
            {
                "tree": str(args.out.resolve()),
                "compiled": compiled,
                "refused": refused,
                "imported_as_source": interpreted,
                "seconds": round(time.monotonic() - started, 1),
            }
        )
    )
    return 1 if interpreted else 0


if __name__ == "__main__":
    raise SystemExit(main())
