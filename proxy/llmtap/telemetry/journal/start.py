"""Opening a telemetry process's record journal at start: its slot in the folder, or none (said) when the folder
cannot be used; the records then go to the sinks unjournaled."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from llmtap.telemetry.journal.spool import Spool
from llmtap.worker import Progress

__all__ = ["SinkLike", "open_spool"]

log = logging.getLogger("llmtap.telemetry")


class SinkLike(Protocol):
    """What the journal reads of a record sink."""

    kind: str
    progress: Progress


def open_spool(
    directory: str | None,
    sinks: Sequence[SinkLike],
    *,
    index: int,
    max_bytes: int,
    on_lost: Callable[[str, int], None] | None = None,
    on_recovered: Callable[[int], None] | None = None,
    on_tapes_lost: Callable[[str, int], None] | None = None,
) -> Spool | None:
    """The journal of telemetry process ``index`` in ``directory`` (None: no folder, or no sink to keep records
    for); a folder that cannot be used is said, and the records go to the sinks unjournaled."""
    if not directory or not sinks:
        return None
    try:
        spool = Spool(
            directory,
            sinks,
            index=index,
            max_bytes=max_bytes,
            on_lost=on_lost,
            on_recovered=on_recovered,
            on_tapes_lost=on_tapes_lost,
        )
    except OSError as exc:
        log.error(
            "record journal %s cannot be used (%s): records are not kept across a restart",
            directory,
            exc.strerror or exc,
        )
        return None
    log.info(
        "record journal %s (at most %d MiB)%s",
        spool.slot.path,
        spool.max_bytes >> 20,
        f"; {len(spool._old)} segments of the last run to replay" if spool._old else "",
    )
    return spool
