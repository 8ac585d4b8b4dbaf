"""``llmtap serve``: the telemetry processes, and one relay (this process) or several (``--workers``).

``run`` binds every listener first (so a taken port fails at once, with its address), starts the telemetry
process (``llmtap.serve.telemetry``) with the admin listener and the channel's socket, then relays in this
process (``llmtap.serve.relay``), on uvloop when installed; with ``workers`` above one a supervisor
(``llmtap.serve.workers``) runs the relays as processes sharing the proxy port. On SIGTERM the relays drain
their streams and hand over their last tapes; then the telemetry process records them and flushes.
"""

from __future__ import annotations

import os
import tempfile

from llmtap.config.types import Settings
from llmtap.serve.relay import serve
from llmtap.serve.server import run_loop
from llmtap.serve.sockets import PROXY_LISTENER, bind
from llmtap.serve.telemetry import TelemetryProcess

__all__ = ["run"]


def run(settings: Settings) -> None:
    """``llmtap serve``: the telemetry process, and one relay here or a supervisor of ``workers`` relays."""
    # A Unix socket's path holds at most 107 bytes: under a deep TMPDIR, fall back to /tmp.
    base = None if len(tempfile.gettempdir()) <= 68 else "/tmp"
    with tempfile.TemporaryDirectory(prefix="llmtap-", dir=base) as folder:
        os.chmod(folder, 0o700)
        channel_path = os.path.join(folder, "telemetry.sock")
        if settings.workers > 1:
            from llmtap.serve.workers import supervise

            supervise(settings, channel_path)
            return
        proxy_sock = bind(settings.host, settings.port, "proxy listener", options=PROXY_LISTENER)
        with TelemetryProcess(settings, channel_path, relays=1) as telemetry:
            run_loop(serve(settings, proxy_sock, channel_path, telemetry=telemetry))
