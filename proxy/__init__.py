"""llmtap: an OpenTelemetry tracing proxy for LLM inference."""

from __future__ import annotations

__version__ = "0.1.0"

from proxy.relay.app import create_app
from proxy.settings import SLO, ConfigError, Route, Settings, Telemetry, Timeouts

__all__ = ["SLO", "ConfigError", "Route", "Settings", "Telemetry", "Timeouts", "__version__", "create_app"]
