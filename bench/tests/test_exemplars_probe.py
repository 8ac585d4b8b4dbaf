"""``python -m bench.probes.exemplars`` runs both reservoirs and reports each one's CPU per request and the ratio."""

from __future__ import annotations

import json

import pytest

from bench.probes import exemplars


def test_the_probe_measures_both_reservoirs_in_every_round(capsys: pytest.CaptureFixture[str]) -> None:
    assert exemplars.main(["--requests", "200", "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    for name in ("walk (SDK)", "bisection (llmtap)"):
        assert len(out[name]["rounds"]) == 2 and out[name]["us_per_request"] > 0, out
    assert out["ratio"] == pytest.approx(
        out["bisection (llmtap)"]["us_per_request"] / out["walk (SDK)"]["us_per_request"]
    )
