"""The live view on the admin listener: recent figures per route and model, and the last requests as waterfalls."""

from llmtap.telemetry.admin.live.view import LiveView
from llmtap.telemetry.admin.live.window import LiveWindow

__all__ = ["LiveView", "LiveWindow"]
