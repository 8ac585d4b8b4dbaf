"""What the relay processes of one server count together: requests in flight to each upstream, admission lines.

With ``llmtap serve --workers N`` the kernel spreads client connections over N relays, and two figures are
the server's, not one relay's:

* **requests in flight to each upstream**, which the slot replay (``llmtap.analysis.estimator``) splits a
  request's upstream TTFT by: a relay that sent one of four would see a free server;
* **each route's admission line** (``max_concurrency``, ``queue_limit``): the limit is on the server's
  requests to the upstream, not on each relay's (``llmtap.relay.admission``).

So the relays share a ``Table`` in memory (a ``memfd`` the supervisor makes and every relay maps): a row per
relay, a named column per figure, each cell a 64-bit integer written by its row's relay alone. A figure of
the server is the sum (or the least) of its column. Reading needs no lock: a sum is as of a moment within
its read. Where a decision must not race another relay's (taking an admission slot), ``locked`` holds a
POSIX record lock on the table for the few microseconds of the decision.

A relay started again after one died clears its row: what it counted died with it. One relay alone
(``llmtap serve`` without ``--workers``) keeps a table of one row in its own memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from llmtap.wire.tape import now

if TYPE_CHECKING:
    from llmtap.config.types import Settings
    from llmtap.wire.tape import Tape

__all__ = ["InFlight", "Table", "line_columns", "table_columns"]

_CELL = 8  # bytes: a signed 64-bit integer


def line_columns(route: str) -> tuple[str, str, str]:
    """The admission line's columns of ``route``: requests each relay admitted, requests waiting in its line, and
    when its first waiter began waiting (``time.perf_counter_ns``; 0: nobody waits)."""
    return f"active {route}", f"waiting {route}", f"head {route}"


def table_columns(settings: Settings) -> list[str]:
    """Every column the relays of ``settings`` share: each upstream's requests in flight, each line's."""
    columns = [f"upstream {r.upstream}" for r in settings.routes]
    for r in settings.routes:
        if r.max_concurrency is not None:
            columns += line_columns(r.name)
    return columns


class Table:
    """Named columns of 64-bit integers, a row per relay: this relay writes its own row and reads every row."""

    def __init__(self, columns: Iterable[str], table: mmap.mmap | bytearray | None = None, row: int = 0) -> None:
        self._columns = {name: i for i, name in enumerate(dict.fromkeys(columns))}
        width = self.width = len(self._columns)
        if table is None:
            table = bytearray(width * _CELL)
        self._table = table  # kept: the view below must not outlive it
        cells = memoryview(table).cast("q")
        rows = self.rows = len(cells) // width if width else 1
        if width and (len(cells) != rows * width or not 0 <= row < rows):
            raise ValueError(f"a table of {len(cells)} cells has no row {row} of {width}")
        self._cells = cells
        self._own = row * width
        for i in range(width):
            cells[self._own + i] = 0
        #: The table's file, for ``locked`` (None: this relay's own memory, nobody to exclude).
        self._fd: int | None = None

    @classmethod
    def create(cls, columns: Iterable[str], rows: int) -> int:
        """A zeroed table for ``rows`` relays, as a file descriptor to hand to each (``attach``)."""
        fd = os.memfd_create("llmtap-relays", flags=0)
        os.ftruncate(fd, max(len(dict.fromkeys(columns)), 1) * rows * _CELL)
        return fd

    @classmethod
    def attach(cls, columns: Iterable[str], fd: int, row: int) -> Table:
        """Relay ``row``'s view of the table at ``fd`` (``create``), which it keeps open; its row starts at zero."""
        table = cls(columns, mmap.mmap(fd, os.fstat(fd).st_size), row)
        table._fd = fd
        return table

    def column(self, name: str) -> int | None:
        """The index of column ``name``, None when the table has none of that name."""
        return self._columns.get(name)

    def total(self, column: int) -> int:
        """The column's sum over every relay."""
        return sum(self._cells[column :: self.width])

    def cells(self, column: int) -> list[int]:
        """The column, a value per relay."""
        return list(self._cells[column :: self.width])

    def mine(self, column: int) -> int:
        """This relay's value."""
        return self._cells[self._own + column]

    def add(self, column: int, delta: int) -> None:
        """Add ``delta`` to this relay's value."""
        self._cells[self._own + column] += delta

    def set(self, column: int, value: int) -> None:
        """Set this relay's value."""
        self._cells[self._own + column] = value

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """No other relay decides on the table meanwhile (a record lock on its first byte; a private table: no-op).

        Blocking, and held for a few reads and writes of memory only: no relay waits on it longer than that, save
        when the scheduler stops the holder in between."""
        fd = self._fd
        if fd is None:
            yield
            return
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
        try:
            yield
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)


class InFlight:
    """Each upstream's requests in flight: this relay's in its own row of the table, everyone's by adding up."""

    def __init__(self, table: Table) -> None:
        self._table = table
        #: Each upstream's column, looked up once (None: not in the table).
        self._columns: dict[str, int | None] = {}
        #: Upstreams outside the table (none when every route's upstream was known at start): this relay's own count.
        self._others: dict[str, int] = {}

    def _column(self, upstream: str) -> int | None:
        try:
            return self._columns[upstream]
        except KeyError:
            column = self._columns[upstream] = self._table.column(f"upstream {upstream}")
            return column

    def begin(self, upstream: str) -> int:
        """A request to ``upstream`` is about to be sent: count it, and return how many were in flight before it."""
        table = self._table
        column = self._column(upstream)
        if column is None:
            ahead = self._others.get(upstream, 0)
            self._others[upstream] = ahead + 1
            return ahead
        ahead = table.total(column)
        table.add(column, 1)
        return ahead

    def leaving(self, upstream: str, tape: Tape) -> None:
        """The request of ``tape`` goes onto its upstream connection now, after any connect (the upstream client
        calls this just before the first byte): the upstream sees the requests in this order, and those already
        in flight, whichever relay wrote them, are ahead of it. ``tape.written`` says it was counted."""
        written = now()
        tape.upstream_ahead = self.begin(upstream)
        tape.written = written  # set once counted: the count's end goes by it

    def end(self, upstream: str) -> None:
        """A request ``begin`` counted is over (answered, failed or cut)."""
        column = self._column(upstream)
        if column is None:
            self._others[upstream] -= 1
        else:
            self._table.add(column, -1)
