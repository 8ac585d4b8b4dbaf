"""A request's walk through the relay: control enters each of its modules at most twice (``tests.support.walk``).

One non-streamed and one streamed request go through a relay served in this thread (llmtap's listener, a loopback
upstream); the profile hook counts, per module, the calls into it from another llmtap module made by the
request's tasks. A module entered again and again is a module whose job is spread over its callers.
"""

from __future__ import annotations

import pytest

from tests.support.walk import Walk, Walks, relay_walk


@pytest.fixture(scope="module", params=[False, True], ids=["as-sent", "usage-spliced"])
def walks(request: pytest.FixtureRequest) -> Walks:
    """As sent, and with the usage request spliced in (the stream's usage event is then cut out)."""
    return relay_walk(inject_usage=request.param)


@pytest.mark.parametrize("kind", ["plain", "streamed"])
def test_each_relay_module_is_entered_at_most_twice(walks: Walks, kind: str) -> None:
    walk: Walk = getattr(walks, kind)
    entries = walk.relay()
    # The walk went where a relayed request goes: in through the application, out through the upstream client.
    for module in ("llmtap.relay.exchange", "llmtap.relay.upstream.transport", "llmtap.relay.upstream.connection"):
        assert entries.get(module, 0) >= 1, entries
    over = {name: count for name, count in entries.items() if count > 2}
    assert not over, (over, {pair: n for pair, n in walk.pairs.items() if pair[1] in over})
    # From any one module, no relay module is entered more than twice.
    repeated = {pair: n for pair, n in walk.pairs.items() if pair[1].startswith("llmtap.relay.") and n > 2}
    assert not repeated, repeated


def test_the_exchange_is_entered_by_the_application_alone(walks: Walks) -> None:
    """The upstream client calls no code of the exchange's (the moment the request leaves is counted in flight
    by ``InFlight.leaving``), and the transport enters the connection once, for the whole exchange."""
    for walk in (walks.plain, walks.streamed):
        into_exchange = {caller for caller, callee in walk.pairs if callee == "llmtap.relay.exchange"}
        assert into_exchange == {"llmtap.relay.app"}, walk.pairs
        assert walk.pairs[("llmtap.relay.upstream.transport", "llmtap.relay.upstream.connection")] == 1
    # The streamed request's parts went to the sink: counted as parts, not as entries.
    assert walks.streamed.parts + sum(walks.streamed.reads.values()) > 0
