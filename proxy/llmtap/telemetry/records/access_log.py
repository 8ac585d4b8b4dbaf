"""The access log (``--access-log PATH``): one line per finished request, written by the telemetry process.

A line is written when the recorder's worker thread has played back the request's tape, so the relay never
waits on it, and it can carry what only playback knows (TTFT as the client saw it, the tokens)::

    2026-12-02T03:46:33.973Z POST /v1/chat/completions 200 ttft=21.3ms in=12 out=64 duration=250.1ms \
        route=default model=gpt-4o

(one line in the file).

A value not known is ``-``; a request that did not end well adds ``error=TYPE``. The path is the one the
client sent, without its query (where some APIs carry keys), percent-encoded so that a line stays one line.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO
from urllib.parse import quote

from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import ConfigError

__all__ = ["PATH_CAP", "AccessLog", "access_line"]

log = logging.getLogger("llmtap.telemetry")

#: Characters of a path kept in a line; a longer one is cut and ends in ``...``.
PATH_CAP = 200
_SAFE = "/:@!$&'()*+,;=-._~%"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}ms"


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def _word(text: str | None) -> str:
    """A value as one word: what is not printable ASCII, spaces included, is percent-encoded."""
    return "-" if not text else quote(text[:PATH_CAP], safe=_SAFE)


def access_line(tl: Timeline, s: Summary) -> str:
    """One request's line (without the newline)."""
    when = datetime.fromtimestamp(tl.received_wall_ns / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    path = _word(tl.path) + ("..." if len(tl.path) > PATH_CAP else "")
    status = "-" if tl.status_code is None else str(tl.status_code)
    model = tl.response_model or (tl.request.model if tl.request is not None else None)
    words = [
        when,
        _word(tl.method),
        path,
        status,
        f"ttft={_ms(s.ttft)}",
        f"in={_count(s.input_tokens)}",
        f"out={_count(s.output_tokens)}",
        f"duration={_ms(s.e2e)}",
        f"route={_word(tl.route)}",
        f"model={_word(model)}",
    ]
    if tl.error_type:
        words.append(f"error={_word(tl.error_type)}")
    return " ".join(words)


class AccessLog:
    """Appends access lines to a file (``-``: this process's stderr); a write that fails is said once."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._own = path != "-"
        try:
            if self._own:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file: TextIO = open(path, "a", encoding="utf-8", buffering=1) if self._own else sys.stderr
        except OSError as exc:
            raise ConfigError(f"access log {path!r}: {exc.strerror or exc}") from None
        self._failing = False

    def write(self, tl: Timeline, s: Summary) -> None:
        """Write one request's line (a recorder listener: runs on its worker thread)."""
        try:
            self._file.write(access_line(tl, s) + "\n")
        except OSError as exc:
            if not self._failing:
                self._failing = True
                log.warning("access log %s: cannot write (%s); lines are lost until it can", self.path, exc)
            return
        if self._failing:
            self._failing = False
            log.warning("access log %s: writing again", self.path)

    def close(self) -> None:
        """Close the file (not stderr)."""
        if self._own:
            self._file.close()
