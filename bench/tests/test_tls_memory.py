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
