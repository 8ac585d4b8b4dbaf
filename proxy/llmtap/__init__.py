"""llmtap: an OpenTelemetry tracing proxy for LLM inference.

Importing the package loads nothing else: the settings' names below are looked up on first use, so a process
that needs one part of llmtap (a relay, ``llmtap --version``) pays for that part alone.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmtap.config.types import SLO, ConfigError, Route, Settings, TelemetrySettings, Timeouts

    #: This llmtap's version (``_version``), read on first use.
    __version__: str

__all__ = ["SLO", "ConfigError", "Route", "Settings", "TelemetrySettings", "Timeouts", "__version__"]

#: The public names and the module each comes from.
_LAZY = {
    name: "llmtap.config.types" for name in ("SLO", "ConfigError", "Route", "Settings", "TelemetrySettings", "Timeouts")
}


def __getattr__(name: str) -> Any:
    """A public name, imported on first use."""
    value: Any
    if name == "__version__":
        value = _version()
    else:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'llmtap' has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def _version() -> str:
    """pyproject.toml's ``version``, the one source of the package's, the image's and the chart's versions.

    Installed, it is read from the distribution's metadata. Run from a source checkout (the package under
    ``proxy/``), it is read from the checkout's pyproject.toml: the metadata of an editable install is written when
    it is installed and would name the version of that day.
    """
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pyproject = os.path.join(checkout, "pyproject.toml")
    if os.path.isfile(pyproject):
        import tomllib

        with open(pyproject, "rb") as f:
            project = tomllib.load(f).get("project", {})
        # Only llmtap's own file: a package installed with ``--target`` may sit two folders below another project.
        if project.get("name") == "llmtap" and isinstance(project.get("version"), str):
            return str(project["version"])
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmtap")
    except PackageNotFoundError:  # the package copied somewhere by hand: no metadata to read
        return "0+unknown"
