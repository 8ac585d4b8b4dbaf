"""Requests in flight to each upstream, counted across every relay process of one server.

The slot replay (``llmtap.analysis.estimator``) splits a request's upstream TTFT by how many requests to
its upstream were in flight when it was sent. With ``llmtap serve --workers N`` those were sent by N
relays, so each relay's own count says too little: a relay that sent one of four would see a free server.
The relays share a table in memory instead (a ``memfd`` the supervisor makes and every relay maps): a row
per relay, a column per upstream, each cell a 64-bit count written by its row's relay alone, so no lock is
needed; a request's count of those ahead of it is the sum of its upstream's column. A cell is read while
another relay may be writing its own, so the sum is as of a moment within that read: exact enough for a
replay whose other inputs are timestamps of the same moments.

A relay started again after one died clears its row (the requests it counted died with it). One relay
alone (``llmtap serve`` without ``--workers``) keeps a table of one row in its own memory.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable

__all__ = ["InFlight"]

_CELL = 8  # bytes: a signed 64-bit count


class InFlight:
    """Each upstream's requests in flight, this relay's in its own row, everyone's by adding up the column."""

    def __init__(self, upstreams: Iterable[str], table: mmap.mmap | bytearray | None = None, row: int = 0) -> None:
        self._columns = {name: i for i, name in enumerate(sorted(set(upstreams)))}
        width = len(self._columns)
        if table is None:
            table = bytearray(width * _CELL)
        self._table = table  # kept: the view below must not outlive it
        cells = memoryview(table).cast("q")
        rows = len(cells) // width if width else 1
        if width and (len(cells) != rows * width or not 0 <= row < rows):
            raise ValueError(f"a table of {len(cells)} cells has no row {row} of {width}")
        self._cells = cells
        self._width = width
        self._own = row * width
        for i in range(width):
            cells[self._own + i] = 0
        #: Upstreams outside the table (none when every route's upstream was known at start): this relay's own count.
        self._others: dict[str, int] = {}

    @classmethod
    def create(cls, upstreams: Iterable[str], rows: int) -> int:
        """A zeroed table for ``rows`` relays, as a file descriptor to hand to each (``attach``)."""
        size = max(len(set(upstreams)), 1) * rows * _CELL
        fd = os.memfd_create("llmtap-inflight", flags=0)
        os.ftruncate(fd, size)
        return fd

    @classmethod
    def attach(cls, upstreams: Iterable[str], fd: int, row: int) -> InFlight:
        """Relay ``row``'s view of the table at ``fd`` (``create``); its row starts at zero."""
        size = os.fstat(fd).st_size
        return cls(upstreams, mmap.mmap(fd, size), row)

    def begin(self, upstream: str) -> int:
        """A request to ``upstream`` is about to be sent: count it, and return how many were in flight before it."""
        column = self._columns.get(upstream)
        if column is None:
            ahead = self._others.get(upstream, 0)
            self._others[upstream] = ahead + 1
            return ahead
        cells = self._cells
        ahead = sum(cells[column :: self._width])
        cells[self._own + column] += 1
        return ahead

    def end(self, upstream: str) -> None:
        """A request ``begin`` counted is over (answered, failed or cut)."""
        column = self._columns.get(upstream)
        if column is None:
            self._others[upstream] -= 1
        else:
            self._cells[self._own + column] -= 1

    def mine(self, upstream: str) -> int:
        """This relay's own requests in flight to ``upstream``."""
        column = self._columns.get(upstream)
        return self._others.get(upstream, 0) if column is None else self._cells[self._own + column]
