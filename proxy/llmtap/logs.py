"""llmtap's logging, set up once per process the same way: one format, and no client library's request lines.

httpx logs every request's full URL at INFO (API keys in the query, Gemini's ``?key=``, included) and httpcore
logs response headers at DEBUG: neither may reach llmtap's log, at any level.
"""

from __future__ import annotations

import logging

__all__ = ["FORMAT", "setup"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Loggers held at WARNING whatever llmtap's level: they would write credentials.
QUIET = ("httpx", "httpcore")


def setup(level: str, *, pid: bool = False, stamp: bool = True) -> None:
    """Log at ``level`` to stderr; ``pid`` puts the process id first (several relay processes share one log),
    ``stamp`` the time (off for the demo's short warnings)."""
    fmt = FORMAT if stamp else "%(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=f"%(process)d {fmt}" if pid else fmt)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
