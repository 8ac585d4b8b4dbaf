"""What the client receives through llmtap, which asks an OpenAI stream for usage, equals what it receives direct.

Two simulators with the same seed and clock answer the same request with the same bytes; one is asked direct,
with the client's own body, the other through llmtap, which splices ``include_usage`` into the body and takes
the usage event back out (``providers/usage_filter.py``). The bytes the client reads must be equal, for vLLM's
shape (the fingerprint moves to the usage chunk when usage is asked for) and OpenAI's (every chunk gains
``"usage": null``), and the ``openai`` SDK's events equal, field for field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from llmtap.config.types import Route, Settings
from llmtap.simulator import get_profile, run_in_thread

pytestmark = pytest.mark.e2e

CHAT: dict[str, Any] = {
    "model": "llmtap-sim",
    "messages": [{"role": "user", "content": "say it"}],
    "max_tokens": 6,
    "stream": True,
}
COMPLETION = {"model": "llmtap-sim", "prompt": "say it", "max_tokens": 6, "stream": True}


def _pair(openai_chunks: bool) -> Iterator[tuple[str, str]]:
    profile = get_profile("fast", openai_chunks=openai_chunks)
    direct = run_in_thread(profile, seed=7, clock=lambda: 1_800_000_000.0)
    behind = run_in_thread(profile, seed=7, clock=lambda: 1_800_000_000.0)
    yield direct.url, behind.url
    direct.stop()
    behind.stop()


@pytest.fixture(params=[False, True], ids=["vllm-shape", "openai-shape"])
def sims(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    yield from _pair(request.param)


def _proxy(proxy_factory: Any, upstream: str, *, inject_usage: bool = True) -> str:
    route = Route(prefix="/", upstream=upstream, name="r", provider="llmtap-sim")
    return str(proxy_factory(Settings(routes=(route,), inject_usage=inject_usage)).url)


def _read(base: str, path: str, body: dict[str, Any]) -> bytes:
    with httpx.stream("POST", base + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        return response.read()


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_spliced_stream_reaches_the_client_byte_for_byte(
    sims: tuple[str, str], proxy_factory: Any, path: str, body: dict[str, Any]
) -> None:
    direct, behind = sims
    expected = _read(direct, path, body)
    asked = _read(direct, path, body | {"stream_options": {"include_usage": True}})
    assert asked != expected  # asking for usage changes more than one event: the test has something to hold
    got = _read(_proxy(proxy_factory, behind), path, body)
    # The second simulator's first answer is the direct one's first: the same id, text and times.
    assert got == expected


def test_openai_sdk_events_are_equal_through_the_splice(
    sims: tuple[str, str], proxy_factory: Any, closing: Any
) -> None:
    direct, behind = sims
    through = _proxy(proxy_factory, behind)

    def events(base: str) -> list[dict[str, Any]]:
        client = closing(openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0))
        stream = client.chat.completions.create(
            model=CHAT["model"], messages=CHAT["messages"], max_tokens=CHAT["max_tokens"], stream=True
        )
        # exclude_unset: a field the wire did not carry stays distinguishable from one it carried as null.
        return [chunk.model_dump(exclude_unset=True) for chunk in stream]

    want, got = events(direct), events(through)
    assert len(want) == 7  # the role chunk and six tokens, the last with its finish_reason and fingerprint
    assert got == want


def test_no_inject_usage_leaves_the_request_and_the_answer_alone(proxy_factory: Any) -> None:
    for direct, behind in _pair(False):
        expected = _read(direct, "/v1/chat/completions", CHAT)
        assert _read(_proxy(proxy_factory, behind, inject_usage=False), "/v1/chat/completions", CHAT) == expected
