"""``python -m bench.probes.connection_setup`` at a small count: a real uvloop listener, real connections."""

from __future__ import annotations

import json

import pytest

from bench.probes import connection_setup


def test_each_round_times_the_protocol_and_its_connection_made(capsys: pytest.CaptureFixture[str]) -> None:
    connection_setup.main(["--connections", "40", "--rounds", "2"])
    out = capsys.readouterr().out
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) == 2
    for result in results:
        assert result["init_us"] > 0 and result["connection_made_us"] > 0
    assert "| protocol made | connection_made |" in out
