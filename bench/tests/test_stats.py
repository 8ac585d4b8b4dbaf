"""The benchmark's figures from raw records: which merged chunks are the path's and which the upstream's."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.report import merged
from bench.stats import analyse, percentile_ms
from llmtap.analysis.stats import quantile

GAP = 0.02


def _records(sent: list[float], reads: list[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One request: the upstream wrote its content events at ``sent``; the client read event i in read ``reads[i]``,
    0.5 ms after it was written."""
    upstream = [{"id": "r1", "arrived": 0.0, "ttft": sent[0], "sent": sent}]
    times = [t + 0.0005 for t in sent]
    client = [{"id": "r1", "sent": 0.0, "end": sent[-1] + 0.001, "status": 200, "times": times, "reads": reads}]
    return client, upstream


def test_a_pair_the_upstream_wrote_together_is_the_upstreams_merge_and_one_it_spaced_is_the_paths() -> None:
    # Events 0-5: the upstream wrote 2 on time after 1 (a gap apart), 4 late, 1.4 ms after 3 (catching up);
    # the client read 1 and 2 together (the path held 1 back) and 3 and 4 together.
    sent = [0.05, 0.07, 0.09, 0.13, 0.1314, 0.15]
    client, upstream = _records(sent, reads=[0, 1, 1, 2, 2, 3])
    fig = analyse("p", 1, client, upstream, gap=GAP)
    assert (fig.merged, fig.merged_by_upstream) == (1, 1)
    assert merged(fig) == "1 +1 by the upstream"
    assert merged(fig.as_dict()) == "1 +1 by the upstream"


def test_events_in_reads_of_their_own_merge_nothing_whatever_the_upstreams_spacing() -> None:
    sent = [0.05, 0.0501, 0.09, 0.11]
    client, upstream = _records(sent, reads=[0, 1, 2, 3])
    fig = analyse("p", 1, client, upstream, gap=GAP)
    assert (fig.merged, fig.merged_by_upstream) == (0, 0)
    assert merged(fig) == "0"


def test_an_event_that_never_reached_the_client_on_its_own_is_the_paths() -> None:
    client, upstream = _records([0.05, 0.07, 0.09], reads=[0, 1, 2])
    client[0]["times"] = client[0]["times"][:2]
    client[0]["reads"] = client[0]["reads"][:2]
    fig = analyse("p", 1, client, upstream, gap=GAP)
    assert (fig.merged, fig.merged_by_upstream) == (1, 0)


def test_the_benchmark_reads_the_same_quantile_in_ms() -> None:
    values = [0.004, 0.001, 0.003, 0.002]
    assert percentile_ms(values, 50) == pytest.approx(1000 * (quantile(values, 0.5) or 0.0)) == pytest.approx(2.5)
    assert math.isnan(percentile_ms([], 99))  # a missing figure in the benchmark's tables
