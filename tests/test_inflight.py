"""The relays' shared count of requests in flight to each upstream (``llmtap.relay.inflight``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmtap.relay.inflight import InFlight

UPSTREAMS = ["http://b:8000", "http://a:8000", "http://b:8000"]  # as routes list them: repeats, any order


def test_each_relay_counts_in_its_row_and_reads_every_row() -> None:
    fd = InFlight.create(UPSTREAMS, rows=2)
    try:
        one, two = InFlight.attach(UPSTREAMS, fd, 0), InFlight.attach(UPSTREAMS, fd, 1)
        assert one.begin("http://a:8000") == 0
        assert two.begin("http://a:8000") == 1  # the other relay's request is ahead of it
        assert two.begin("http://b:8000") == 0  # per upstream
        assert one.begin("http://a:8000") == 2
        one.end("http://a:8000")
        assert two.begin("http://a:8000") == 2  # one of relay 0's, one of its own
        assert (one.mine("http://a:8000"), two.mine("http://a:8000"), two.mine("http://b:8000")) == (1, 2, 1)
        # Relay 1 dies with its requests in flight; the one started in its place clears the row.
        again = InFlight.attach(UPSTREAMS, fd, 1)
        assert again.begin("http://a:8000") == 1 and again.begin("http://b:8000") == 0
    finally:
        os.close(fd)


def test_an_upstream_outside_the_table_is_counted_by_its_relay_alone() -> None:
    fd = InFlight.create(UPSTREAMS, rows=2)
    try:
        one, two = InFlight.attach(UPSTREAMS, fd, 0), InFlight.attach(UPSTREAMS, fd, 1)
        assert one.begin("http://c:8000") == 0 and one.begin("http://c:8000") == 1
        assert two.begin("http://c:8000") == 0
        one.end("http://c:8000")
        assert one.mine("http://c:8000") == 1
    finally:
        os.close(fd)


def test_a_relay_alone_keeps_its_own_table() -> None:
    alone = InFlight(UPSTREAMS)
    assert [alone.begin("http://a:8000") for _ in range(3)] == [0, 1, 2]
    alone.end("http://a:8000")
    assert alone.begin("http://a:8000") == 2
    assert InFlight([]).begin("http://a:8000") == 0  # no routes known: every upstream counted alone


def test_a_row_past_the_table_is_refused() -> None:
    fd = InFlight.create(UPSTREAMS, rows=2)
    try:
        with pytest.raises(ValueError, match="no row 2"):
            InFlight.attach(UPSTREAMS, fd, 2)
    finally:
        os.close(fd)


def test_another_process_sees_the_counts_through_the_descriptor_it_was_given() -> None:
    """As the supervisor hands the table to each relay: a child process attaches row 1 and reads row 0's count."""
    fd = InFlight.create(UPSTREAMS, rows=2)
    try:
        parent = InFlight.attach(UPSTREAMS, fd, 0)
        parent.begin("http://b:8000")
        parent.begin("http://b:8000")
        code = (
            "import sys; from llmtap.relay.inflight import InFlight; "
            f"t = InFlight.attach({UPSTREAMS!r}, int(sys.argv[1]), 1); "
            "print(t.begin('http://b:8000'), t.begin('http://b:8000'))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(fd)], pass_fds=(fd,), capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == ["2", "3"]
        assert parent.begin("http://b:8000") == 4  # the child's two stay counted in its row
    finally:
        os.close(fd)
