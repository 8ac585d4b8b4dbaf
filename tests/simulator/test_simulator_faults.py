"""The simulator's faults on request: a 5xx in the protocol's error shape, a stream cut midway, a slow first byte.

Each is asked for the way a test or a soak asks: the ``x-sim-fault`` header, or ``--fault`` with ``--fault-rate``;
and each reaches the ``openai`` and ``anthropic`` SDKs as the failure a real server's would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from llmtap import cli
from llmtap.simulator import get_profile, run_in_thread
from llmtap.simulator.faults import Fault, FaultPlan, parse_fault
from llmtap.simulator.requests import SimError

CHAT: Any = {"model": "llmtap-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    running = run_in_thread(get_profile("fast"))
    yield running.url
    running.stop()


@pytest.fixture
def sdks(sim: str) -> Iterator[tuple[openai.OpenAI, anthropic.Anthropic]]:
    """Both SDKs' clients on the simulator, no retries, closed after the test (their connections with them)."""
    with (
        openai.OpenAI(base_url=sim + "/v1", api_key="k", max_retries=0) as client,
        anthropic.Anthropic(base_url=sim, api_key="k", max_retries=0) as claude,
    ):
        yield client, claude


def _last_record(sim: str) -> dict[str, object]:
    return dict(httpx.get(sim + "/debug/requests").json()["requests"][-1])


def test_specs_parse_and_bad_ones_say_which_term() -> None:
    assert parse_fault("status=503; cut-after=2 ;first-byte-delay=0.5") == Fault(503, 2, 0.5)
    assert parse_fault("") == Fault()
    for spec, words in [
        ("status=404", "500 to 599"),
        ("cut-after=-1", "0 or more"),
        ("first-byte-delay=9999", "0 to 600"),
        ("status", "key=value"),
        ("slow=1", "known keys"),
        ("status=abc", "not a number"),
    ]:
        with pytest.raises(SimError, match=words) as caught:
            parse_fault(spec)
        assert caught.value.status == 400


def test_a_5xx_reaches_each_sdk_in_its_protocols_shape(
    sim: str, sdks: tuple[openai.OpenAI, anthropic.Anthropic]
) -> None:
    client, claude = sdks
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(**CHAT, extra_headers={"x-sim-fault": "status=503"})
    assert caught.value.status_code == 503 and "simulated fault" in caught.value.message
    assert _last_record(sim)["error"] == "fault: status=503"
    with pytest.raises(anthropic.InternalServerError) as failed:
        claude.messages.create(**CHAT, extra_headers={"x-sim-fault": "status=529"})
    assert failed.value.status_code == 529
    assert failed.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": "simulated fault (status=529)"},
    }


def test_a_cut_stream_ends_without_its_end_of_body(sim: str, sdks: tuple[openai.OpenAI, anthropic.Anthropic]) -> None:
    client, claude = sdks
    stream = client.chat.completions.create(**CHAT, stream=True, extra_headers={"x-sim-fault": "cut-after=3"})
    got = []
    with pytest.raises(openai.APIConnectionError) as broken:
        for chunk in stream:
            got.append(chunk)
    # The role chunk and the first three chunks of tokens arrived; no finish_reason, no [DONE].
    assert [c.choices[0].delta.content for c in got[1:]] and len(got) == 4
    assert all(c.choices[0].finish_reason is None for c in got)
    assert "incomplete chunked read" in str(broken.value.__cause__)
    record = _last_record(sim)
    assert record["error"] == "fault: cut-after=3" and record["output_tokens"] == 3
    texts: list[str] = []
    with pytest.raises(anthropic.APIConnectionError):
        with claude.messages.stream(**CHAT, extra_headers={"x-sim-fault": "cut-after=2"}) as events:
            texts.extend(events.text_stream)
    assert len(texts) == 2


def test_a_slow_first_byte_delays_the_headers(sim: str) -> None:
    start = time.monotonic()
    with httpx.stream(
        "POST",
        sim + "/v1/chat/completions",
        json=CHAT | {"stream": True},
        headers={"x-sim-fault": "first-byte-delay=0.6"},
    ) as response:
        headers_at = time.monotonic() - start
        body = response.read()
    assert headers_at >= 0.6  # never earlier: the delay is a floor, a busy machine only adds to it
    assert body.endswith(b"data: [DONE]\n\n")


def test_a_bad_fault_header_is_a_400(sim: str) -> None:
    r = httpx.post(sim + "/v1/chat/completions", json=CHAT, headers={"x-sim-fault": "status=200"})
    assert r.status_code == 400 and "x-sim-fault" in r.json()["error"]["message"]


def test_the_server_plays_its_fault_on_its_share_of_requests() -> None:
    running = run_in_thread(get_profile("fast"), faults=FaultPlan(Fault(status=500), rate=0.5, seed=3))
    try:
        codes = [httpx.post(running.url + "/v1/chat/completions", json=CHAT).status_code for _ in range(40)]
    finally:
        running.stop()
    assert set(codes) == {200, 500} and 8 <= codes.count(500) <= 32


def test_simulate_refuses_a_fault_it_cannot_play(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--fault", "status=99"]) == 2
    assert "--fault" in capsys.readouterr().err
    assert cli.main(["simulate", "--fault", "status=500", "--fault-rate", "2"]) == 2
