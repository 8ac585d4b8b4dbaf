"""The live view on the admin listener: recent figures per route and model, and the last requests as waterfalls."""

from proxy.live.view import LiveView
from proxy.live.window import LiveWindow

__all__ = ["LiveView", "LiveWindow"]
