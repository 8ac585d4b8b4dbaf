"""``bench.probes.layers``: each layer's server answers every request of a run, its CPU read apart from the direct
path's."""

from __future__ import annotations

import pytest
import uvloop

from bench.probes.layers import LAYERS, _one


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_answers_every_request(layer: str) -> None:
    got = uvloop.run(_one(layer, 300))
    # The client raises on an answer that is not a 200 with the fixed body's framing: every request came back whole.
    assert (got["layer"], got["requests"]) == (layer, 300)
    assert got["direct_us_per_request"] > 0
