"""The developer generators under ``docs/generate/`` (not in the package): loaded by path for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FOLDER = Path(__file__).resolve().parents[2] / "docs" / "generate"


def load(name: str) -> ModuleType:
    """``docs/generate/NAME.py`` as a module (``reference`` or ``settings``)."""
    qualified = f"_llmtap_generate_{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    spec = importlib.util.spec_from_file_location(qualified, FOLDER / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no generator {name}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module
