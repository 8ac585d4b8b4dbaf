"""``bench.probes.short_exchange``: one run relays every request through llmtap and reads the relay's CPU apart."""

from __future__ import annotations

import pytest
import uvloop

from bench.probes.short_exchange import _one


def test_a_run_relays_every_request_and_measures_the_relay_apart() -> None:
    got = uvloop.run(_one(300))
    assert got["requests"] == 300
    # Every request came back 200 through the relay (the client raises otherwise), and relayed costs more than direct.
    assert got["relayed_us_per_request"] > got["direct_us_per_request"] > 0
    assert got["relay_us_per_request"] == pytest.approx(got["relayed_us_per_request"] - got["direct_us_per_request"])
