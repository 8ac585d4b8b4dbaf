"""The layout holds what it promises: the relay process loads no OpenTelemetry and no tokenizer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELAY = ROOT / "proxy" / "llmtap" / "relay"


def test_the_relay_process_imports_no_opentelemetry_and_no_tokenizer() -> None:
    code = (
        "import sys\n"
        "import llmtap.relay.server, llmtap.relay.workers\n"
        "from llmtap.relay.app import create_app\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('opentelemetry', 'tiktoken'))}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_relay_modules_import_telemetry_only_where_it_is_started_or_embedded() -> None:
    """At module level, the relay reaches the telemetry side only to start its process (``telemetry.process``)."""
    found: dict[str, list[str]] = {}
    for path in sorted(RELAY.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only: imports inside functions run where they are called
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith(("llmtap.telemetry", "llmtap.analysis", "opentelemetry", "tiktoken")):
                    found.setdefault(path.name, []).append(node.module)
    assert found == {"server.py": ["llmtap.telemetry"], "workers.py": ["llmtap.telemetry.process"]}, found
