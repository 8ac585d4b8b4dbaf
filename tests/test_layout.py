"""The layout holds what it promises: the relay process loads no OpenTelemetry and no tokenizer, and the
layer contracts in pyproject.toml (``lint-imports``) are kept, and would catch an import that breaks one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_relay_process_imports_no_opentelemetry_and_no_tokenizer() -> None:
    # What a relay process of ``llmtap serve`` imports (``llmtap.serve.relay``, and the supervisor's modules
    # that run in the same process), and the relay application itself.
    code = (
        "import sys\n"
        "import llmtap.serve.run, llmtap.serve.relay, llmtap.serve.workers\n"
        "from llmtap.relay.app import create_app\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('opentelemetry', 'tiktoken'))}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _lint_imports(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[test]'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "proxy"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([exe, "--no-cache", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_are_kept() -> None:
    done = _lint_imports()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout and "broken" in done.stdout


def test_a_relay_module_that_imports_the_telemetry_side_breaks_a_contract(tmp_path: Path) -> None:
    """The contracts can fail: a copy of the package whose relay imports the recorder is refused."""
    copy = tmp_path / "proxy"
    shutil.copytree(ROOT / "proxy" / "llmtap", copy / "llmtap", ignore=shutil.ignore_patterns("__pycache__", "data"))
    guard = copy / "llmtap" / "relay" / "guard.py"
    guard.write_text(guard.read_text(encoding="utf-8") + "\nfrom llmtap.telemetry import recorder as _recorder\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    env_path = f"{copy}"
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[test]'")
    done = subprocess.run(
        [exe, "--no-cache"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": env_path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0, done.stdout
    assert "llmtap.relay.guard -> llmtap.telemetry.recorder" in done.stdout
    assert "BROKEN" in done.stdout
