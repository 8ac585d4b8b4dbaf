"""Prompt-version labels: what a client's ``x-llmtap-prompt-version`` (or a route's version) may become.

Shared by the settings (a route's configured version is checked at start) and the telemetry side.
"""

from __future__ import annotations

#: A version label longer than this or with control characters is not used as a label.
VERSION_MAX_BYTES = 128
INVALID_VERSION = "invalid"


def version_label(raw: bytes | str | None) -> str | None:
    """A prompt version fit to be a label: None when absent, ``invalid`` when too long or with control characters.

    The request itself always goes through: only the label is refused.
    """
    if raw is None:
        return None
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    data = data.strip(b" ")
    if not data:
        return None
    if len(data) > VERSION_MAX_BYTES or any(b < 0x20 or b == 0x7F for b in data):
        return INVALID_VERSION
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return INVALID_VERSION
