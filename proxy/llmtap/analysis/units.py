"""Durations and moments as people write and read them: ``781 ms``, ``1h``, ``2026-05-01T12:00:00Z``."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from llmtap.config.types import ConfigError

__all__ = ["parse_duration", "parse_time", "seconds"]


def seconds(v: float | None) -> str:
    """A duration as people read it: ``781 ms`` under a second, ``1.23 s`` from there."""
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"


def parse_time(text: str) -> float:
    """Epoch seconds of an ISO 8601 time; without a zone it is UTC."""
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{text!r} is not an ISO 8601 time such as 2026-05-01T12:00:00Z") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def parse_duration(text: str) -> float:
    """Seconds of ``90``, ``90s``, ``30m``, ``1h`` or ``2d``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(f"{text!r} is not a duration such as 90s, 30m, 1h or 2d")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
