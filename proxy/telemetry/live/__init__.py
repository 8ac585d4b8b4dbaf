"""The live view on the admin listener: recent figures per route and model, and the last requests as waterfalls."""

from proxy.telemetry.live.view import LiveView
from proxy.telemetry.live.window import LiveWindow

__all__ = ["LiveView", "LiveWindow"]
