"""``python -m bench.probes.tls_memory`` end to end at small counts: real server and client processes, real TLS."""

from __future__ import annotations

import json

import pytest

from bench.probes import tls_memory


def test_every_kind_is_measured_and_a_tls_connection_holds_more_than_a_plain_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tls_memory.main(["--connections", "16", "--exchanges", "2", "--rounds", "1"])
    out = capsys.readouterr().out
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    by_kind = {(r["transport"], r["loop"]): r for r in results}
    assert set(by_kind) == set(tls_memory.KINDS)
    # OpenSSL's state per connection is tens of KiB; a plain socket's, a page or less.
    assert by_kind[("tls", "uvloop")]["used_kib"] > by_kind[("plain", "uvloop")]["used_kib"] + 8
    assert "| tls | uvloop |" in out and "| plain | uvloop |" in out


def test_connections_opened_at_once_are_measured_and_said_so(capsys: pytest.CaptureFixture[str]) -> None:
    tls_memory.main(["--connections", "16", "--exchanges", "2", "--rounds", "1", "--together"])
    out = capsys.readouterr().out
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    by_kind = {(r["transport"], r["loop"]): r for r in results}
    assert set(by_kind) == set(tls_memory.KINDS)
    assert by_kind[("tls", "uvloop")]["used_kib"] > by_kind[("plain", "uvloop")]["used_kib"] + 8
    assert "16 connections opened at once" in out


def test_the_breakdown_of_connections_read_as_the_relay_reads(capsys: pytest.CaptureFixture[str]) -> None:
    tls_memory.main(["--connections", "16", "--exchanges", "2", "--rounds", "1", "--relay-reads", "--breakdown"])
    out = capsys.readouterr().out
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    by_kind = {(r["transport"], r["loop"]): r for r in results}
    tls_uvloop = by_kind[("tls", "uvloop")]
    # Each TLS transport's 256 KiB read buffer is a block of its own, in a mapping under the relay's malloc setting;
    # OpenSSL's state is what is left of the blocks in use once Python's (the buffer among them) is taken off.
    assert tls_uvloop["loop_read_buffer_kib"] == 256
    assert tls_uvloop["of_it_mapped_kib"] >= 256
    assert tls_uvloop["openssl_kib"] > 4 * by_kind[("plain", "uvloop")]["openssl_kib"] + 8
    assert "read as the relay reads" in out and "What holds it" in out
