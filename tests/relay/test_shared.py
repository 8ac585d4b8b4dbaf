"""What the relays of one server count together (``llmtap.relay.shared``): requests in flight, admission lines."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from llmtap.relay.admission import POLL, Admission, QueueFull
from llmtap.relay.shared import InFlight, Table, line_columns

UPSTREAMS = ["upstream http://b:8000", "upstream http://a:8000", "upstream http://b:8000"]  # repeats, any order
COLUMNS = [*UPSTREAMS, *line_columns("chat")]


@pytest.fixture
def table_fd() -> Iterator[int]:
    fd = Table.create(COLUMNS, rows=2)
    yield fd
    os.close(fd)


def test_each_relay_counts_in_its_row_and_reads_every_row(table_fd: int) -> None:
    one, two = InFlight(Table.attach(COLUMNS, table_fd, 0)), InFlight(Table.attach(COLUMNS, table_fd, 1))
    assert one.begin("http://a:8000") == 0
    assert two.begin("http://a:8000") == 1  # the other relay's request is ahead of it
    assert two.begin("http://b:8000") == 0  # per upstream
    assert one.begin("http://a:8000") == 2
    one.end("http://a:8000")
    assert two.begin("http://a:8000") == 2  # one of relay 0's, one of its own
    # Relay 1 dies with its requests in flight; the one started in its place clears the row.
    again = InFlight(Table.attach(COLUMNS, table_fd, 1))
    assert again.begin("http://a:8000") == 1 and again.begin("http://b:8000") == 0


def test_an_upstream_outside_the_table_is_counted_by_its_relay_alone(table_fd: int) -> None:
    one, two = InFlight(Table.attach(COLUMNS, table_fd, 0)), InFlight(Table.attach(COLUMNS, table_fd, 1))
    assert one.begin("http://c:8000") == 0 and one.begin("http://c:8000") == 1
    assert two.begin("http://c:8000") == 0
    one.end("http://c:8000")
    assert one.begin("http://c:8000") == 1


def test_a_relay_alone_keeps_its_own_table() -> None:
    alone = InFlight(Table(COLUMNS))
    assert [alone.begin("http://a:8000") for _ in range(3)] == [0, 1, 2]
    alone.end("http://a:8000")
    assert alone.begin("http://a:8000") == 2
    assert InFlight(Table([])).begin("http://a:8000") == 0  # no routes known: every upstream counted alone


def test_a_row_past_the_table_is_refused(table_fd: int) -> None:
    with pytest.raises(ValueError, match="no row 2"):
        Table.attach(COLUMNS, table_fd, 2)


def test_another_process_sees_the_counts_through_the_descriptor_it_was_given(table_fd: int) -> None:
    """As the supervisor hands the table to each relay: a child process attaches row 1 and reads row 0's count."""
    parent = InFlight(Table.attach(COLUMNS, table_fd, 0))
    parent.begin("http://b:8000")
    parent.begin("http://b:8000")
    code = (
        "import sys; from llmtap.relay.shared import InFlight, Table; "
        f"t = InFlight(Table.attach({COLUMNS!r}, int(sys.argv[1]), 1)); "
        "print(t.begin('http://b:8000'), t.begin('http://b:8000'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(table_fd)], pass_fds=(table_fd,), capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["2", "3"]
    assert parent.begin("http://b:8000") == 4  # the child's two stay counted in its row


def lines(table_fd: int, limit: int = 2, queue_limit: int = 10) -> tuple[Admission, Admission]:
    """The route's admission line in two relays of one server."""
    return tuple(  # type: ignore[return-value]
        Admission(limit, queue_limit, table=Table.attach(COLUMNS, table_fd, row), route="chat") for row in (0, 1)
    )


async def settle() -> None:
    """Long enough for a relay's look at the others' lines (``POLL``), several times over."""
    await asyncio.sleep(POLL * 10)


async def test_the_limit_is_the_servers_not_each_relays(table_fd: int) -> None:
    one, two = lines(table_fd)
    await one.acquire()
    assert two.free
    await two.acquire()
    assert not one.free and not two.free  # two of two slots taken, one in each relay
    waiting = asyncio.create_task(two.acquire())
    await settle()
    assert not waiting.done() and two.waiting == 1
    one.release()  # relay 0 frees a slot: relay 1's waiter takes it
    await asyncio.wait_for(waiting, 1)
    assert (one.active, two.active) == (0, 2)
    two.release()
    two.release()
    assert one.free and two.free


async def test_the_first_to_wait_in_any_relay_is_the_first_let_in(table_fd: int) -> None:
    one, two = lines(table_fd, limit=1)
    await one.acquire()
    order: list[str] = []

    async def wait(line: Admission, name: str) -> None:
        await line.acquire()
        order.append(name)

    first = asyncio.create_task(wait(two, "relay 1, first"))
    await asyncio.sleep(0)
    second = asyncio.create_task(wait(one, "relay 0, second"))
    await asyncio.sleep(0)
    assert not one.free  # nobody new jumps a line, whichever relay it is in
    one.release()  # relay 0 frees the slot; its own waiter came later, so relay 1's takes it
    await asyncio.wait_for(first, 1)
    await settle()
    assert order == ["relay 1, first"] and not second.done()
    two.release()
    await asyncio.wait_for(second, 1)
    assert order == ["relay 1, first", "relay 0, second"]
    one.release()


async def test_the_bound_on_the_line_counts_every_relays_waiters(table_fd: int) -> None:
    one, two = lines(table_fd, limit=1, queue_limit=2)
    await one.acquire()
    waiters = [asyncio.create_task(one.acquire()), asyncio.create_task(two.acquire())]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull, match="queue_full"):
        await two.acquire()
    # One gives up: its place in the line is free again, in both relays' count.
    waiters[0].cancel()
    await asyncio.gather(waiters[0], return_exceptions=True)
    third = asyncio.create_task(one.acquire())
    await asyncio.sleep(0)
    assert not third.done()
    one.release()
    await asyncio.wait_for(waiters[1], 1)  # relay 1's waiter came before the third
    two.release()
    await asyncio.wait_for(third, 1)
    one.release()
    assert one.free and two.free
