"""The relay and the telemetry side in one process: tests, the demo and benchmarks.

``in_process`` builds the recorder from the given providers and hands the relay a ``LocalChannel`` to it:
each finished request's tape is played back on the recorder's thread, in this process. The relay itself
never builds telemetry (``llmtap.relay.app``). The returned pair also serves an admin listener
(``AdminApp(local, prometheus)``): it reads the recorder, and the relay's readiness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from llmtap.config.types import Settings
from llmtap.relay.app import ProxyApp, create_app
from llmtap.relay.channel import LocalChannel
from llmtap.telemetry.recorder import Recorder

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

__all__ = ["in_process"]


class InProcess(NamedTuple):
    """The relay application and the recorder its tapes go to; also what an in-process admin listener reads."""

    app: ProxyApp
    recorder: Recorder

    @property
    def settings(self) -> Settings:
        """The settings both were built from."""
        return self.app.settings

    @property
    def ready(self) -> bool:
        """Ready when the relay is (its start-up ran, no drain began)."""
        return self.app.ready


def in_process(
    settings: Settings,
    *,
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
) -> InProcess:
    """The relay with its telemetry in this process: a recorder over the given providers (the global ones
    when None), behind a ``LocalChannel``. Closing the app (its shutdown) drains and closes the recorder."""
    from llmtap.analysis import tokens

    recorder = Recorder(settings, tracer_provider=tracer_provider, meter_provider=meter_provider)
    # Load the default encoding now, not on the first request's playback.
    tokens.get_encoding()
    return InProcess(create_app(settings, channel=LocalChannel(recorder)), recorder)
