"""llmtap: an OpenTelemetry tracing proxy for LLM inference.

Importing the package loads nothing else: the settings' names below are looked up on first use, so a process
that needs one part of llmtap (a relay, ``llmtap --version``) pays for that part alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from llmtap.config.types import SLO, ConfigError, Route, Settings, TelemetrySettings, Timeouts

__all__ = ["SLO", "ConfigError", "Route", "Settings", "TelemetrySettings", "Timeouts", "__version__"]

#: The public names and the module each comes from.
_LAZY = {
    name: "llmtap.config.types" for name in ("SLO", "ConfigError", "Route", "Settings", "TelemetrySettings", "Timeouts")
}


def __getattr__(name: str) -> Any:
    """A public name, imported on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmtap' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
