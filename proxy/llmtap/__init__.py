"""llmtap: an OpenTelemetry tracing proxy for LLM inference."""

from __future__ import annotations

__version__ = "0.1.0"

from llmtap.config.settings import SLO, ConfigError, Route, Settings, Telemetry, Timeouts
from llmtap.relay.app import create_app

__all__ = ["SLO", "ConfigError", "Route", "Settings", "Telemetry", "Timeouts", "__version__", "create_app"]
