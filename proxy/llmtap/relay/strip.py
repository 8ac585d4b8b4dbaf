"""The cut of the usage event the relay asked for, from the stream it relays: failure-tolerant, never losing a byte."""

from __future__ import annotations

import logging

from llmtap.providers.usage_filter import UsageEventFilter

__all__ = ["strip_part"]

log = logging.getLogger("llmtap.proxy")


def strip_part(strip: UsageEventFilter, chunk: bytes | None) -> tuple[bytes, UsageEventFilter | None]:
    """The bytes to send for ``chunk`` (None: the end) with the injected usage event cut out.

    A filter that fails is dropped for the rest of the stream, its held bytes sent as they are: the
    client may then see the usage event it did not ask for, never lose a byte.
    """
    try:
        return (strip.feed(chunk) if chunk is not None else strip.flush()), strip
    except Exception:
        log.exception("usage filter failed; relaying the rest unfiltered")
        return strip.flush(), None
