"""llmtap: an OpenTelemetry tracing proxy for LLM inference."""

from __future__ import annotations

__version__ = "0.1.0"

from llmtap.config.types import SLO, ConfigError, Route, Settings, TelemetrySettings, Timeouts
from llmtap.relay.app import create_app

__all__ = ["SLO", "ConfigError", "Route", "Settings", "TelemetrySettings", "Timeouts", "__version__", "create_app"]
