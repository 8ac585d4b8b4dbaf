"""Cache diagnosis: every class from its rule, then each one produced by a real prefix cache through the proxy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from llmtap.analysis import tokens
from llmtap.analysis.cachediag import (
    BLOCK_MIN_TOKENS,
    COLD,
    HIT,
    HOSTED_MIN_TOKENS,
    MISS_CHANGED,
    MISS_EVICTED,
    TOO_SHORT,
    UNKNOWN,
    classify,
    min_cacheable_tokens,
    self_hosted,
)
from llmtap.analysis.fingerprint import PrefixMatch
from llmtap.config.types import Route, Settings
from llmtap.simulator import get_profile, run_in_thread
from llmtap.simulator.text import Vocabulary
from llmtap.telemetry import semconv as sc
from tests.conftest import Telemetry

KNOWN_NOTHING = PrefixMatch(shared_tokens=0, known=False, diverged=None)
CHANGED = PrefixMatch(shared_tokens=10, known=True, diverged="system")
UNCHANGED = PrefixMatch(shared_tokens=5000, known=True, diverged="m0")


@pytest.mark.parametrize(
    ("input_tokens", "cached", "match", "expected"),
    [
        (6200, 5248, UNCHANGED, (HIT, 5000)),
        (6200, 5248, KNOWN_NOTHING, (HIT, 0)),  # the server is the truth, even when the proxy saw nothing
        (6200, 0, KNOWN_NOTHING, (COLD, 0)),
        (6200, 0, CHANGED, (MISS_CHANGED, 0)),  # 10 shared tokens are below what the server caches
        (6200, 0, UNCHANGED, (MISS_EVICTED, 5000)),
        (500, 0, UNCHANGED, (TOO_SHORT, 499)),  # the last prompt token is never read from a cache
        (500, None, KNOWN_NOTHING, (TOO_SHORT, 0)),
        (6200, None, UNCHANGED, (UNKNOWN, 5000)),  # the server reported no cached-token count
        (6200, 0, None, (UNKNOWN, 0)),  # no fingerprint (the body was not read)
        (None, 0, UNCHANGED, (MISS_EVICTED, 5000)),
    ],
)
def test_classes(
    input_tokens: int | None, cached: int | None, match: PrefixMatch | None, expected: tuple[str, int]
) -> None:
    assert classify(input_tokens=input_tokens, cached_tokens=cached, match=match, min_tokens=1024) == expected


def test_the_least_a_server_caches() -> None:
    def route(upstream: str = "https://api.openai.com", **kw: Any) -> Route:
        return Route(prefix="/", upstream=upstream, name="r", **kw)

    assert min_cacheable_tokens(route(provider="vllm")) == BLOCK_MIN_TOKENS == 16
    assert min_cacheable_tokens(route(provider="openai")) == HOSTED_MIN_TOKENS == 1024
    assert min_cacheable_tokens(route()) == 1024
    assert min_cacheable_tokens(route(provider="anthropic", cache_min_tokens=2048)) == 2048
    assert min_cacheable_tokens(None) == 1024
    # The provider named decides, whatever the address.
    assert min_cacheable_tokens(route("http://127.0.0.1:8000", provider="openai")) == 1024
    assert min_cacheable_tokens(route("https://vllm.example.com", provider="vLLM")) == 16


@pytest.mark.parametrize(
    ("upstream", "local"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://[::1]:8000", True),
        ("http://localhost:11434", True),
        ("http://10.2.3.4:8000", True),
        ("http://172.20.0.5", True),
        ("http://192.168.1.20:8080", True),
        ("http://[fd12:3456::1]:8000", True),  # RFC 4193 unique local
        ("http://169.254.10.1", True),  # link-local
        ("http://100.72.0.9:8000", True),  # RFC 6598 shared address space
        ("http://vllm:8000", True),  # a name without dots: a container's or a pod's peer
        ("http://vllm.ml.svc.cluster.local:8000", True),
        ("http://gpu-box.local:8000", True),
        ("http://llm.corp.internal", True),
        ("https://api.openai.com", False),
        ("https://api.anthropic.com", False),
        ("https://openrouter.ai/api", False),
        ("http://8.8.8.8", False),
        ("https://[2001:4860:4860::8888]", False),
    ],
)
def test_a_route_without_a_provider_is_self_hosted_by_its_address(upstream: str, local: bool) -> None:
    route = Route(prefix="/", upstream=upstream, name="r")
    assert self_hosted(route) is local
    assert min_cacheable_tokens(route) == (BLOCK_MIN_TOKENS if local else HOSTED_MIN_TOKENS)


@pytest.fixture
def sims() -> Iterator[tuple[str, str]]:
    """Two simulated servers (blocks of 16 tokens): a roomy prefix cache, and one of 8 blocks that evicts fast."""
    roomy = run_in_thread(get_profile("fast"))
    tiny = run_in_thread(get_profile("fast", cache_blocks=8))
    yield roomy.url, tiny.url
    roomy.stop()
    tiny.stop()


@pytest.mark.e2e
def test_each_class_through_the_proxy(sims: tuple[str, str], proxy_factory: Any, telemetry: Telemetry) -> None:
    roomy, tiny = sims
    routes = (
        Route(prefix="/roomy", upstream=roomy, name="roomy", provider="llmtap-sim", strip_prefix=True),
        Route(prefix="/tiny", upstream=tiny, name="tiny", provider="llmtap-sim", strip_prefix=True),
        Route(prefix="/hosted", upstream=roomy, name="hosted", strip_prefix=True, cache_min_tokens=1024),
        # No provider named: the upstream's loopback address makes it self-hosted (a block of 16 tokens).
        Route(prefix="/local", upstream=tiny, name="local", strip_prefix=True),
    )
    proxy = proxy_factory(Settings(routes=routes))
    vocab = Vocabulary("o200k_base")

    def text(seed: str, n: int) -> str:
        return "".join(vocab.generate(seed, n))

    def send(route: str, system: str, user: str, version: str) -> None:
        body = {
            "model": "llmtap-sim",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 2,
            "stream": True,
        }
        headers = {"x-llmtap-prompt-version": version}
        with httpx.stream("POST", f"{proxy.url}/{route}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            r.read()

    fixed, other = text("fixed", 400), text("other", 400)
    send("roomy", fixed, text("q1", 50), "a")  # nothing sent before: cold
    send("roomy", other, text("q1", 50), "b")  # the system prompt changed: nothing to reuse
    send("roomy", fixed, text("q2", 50), "a")  # the system prompt again: read from the cache
    send("tiny", fixed, text("q1", 50), "a")  # cold
    send("tiny", other, text("q1", 50), "b")  # changed, and evicts the first prompt's 8 blocks
    send("tiny", fixed, text("q1", 50), "a")  # unchanged, yet nothing cached: evicted
    send("hosted", text("short", 100), "hi", "a")  # under the 1,024 tokens a hosted API caches
    # Under 1,024 tokens, on a local server with no provider named: a hit of what its 8 blocks still hold, and
    # the whole prompt sent before is the expected prefix (a 1,024-token minimum would expect none).
    send("local", fixed, text("q1", 50), "a")
    proxy.flush()

    roots = sorted((s for s in telemetry.finished() if s.name.startswith("chat")), key=lambda s: s.start_time or 0)
    got = [
        (
            a[sc.ROUTE],
            a[sc.CACHE_CLASS],
            a.get(sc.CACHE_CHANGED_REGION),
            a[sc.CACHE_EXPECTED_PREFIX],
            a.get(sc.USAGE_CACHE_READ),
        )
        for a in (dict(s.attributes or {}) for s in roots)
    ]
    system_tokens = tokens.count(fixed)  # the simulator counts prompts with the same encoding
    cached = system_tokens // 16 * 16
    assert got == [
        ("roomy", COLD, None, 0, 0),
        ("roomy", MISS_CHANGED, "system", 0, 0),
        ("roomy", HIT, "m0", system_tokens, cached),
        ("tiny", COLD, None, 0, 0),
        ("tiny", MISS_CHANGED, "system", 0, 0),
        ("tiny", MISS_EVICTED, None, system_tokens + 50, 0),
        # The same upstream and model as "roomy": its prompts are known there, but this one is short.
        ("hosted", TOO_SHORT, "system", 0, 0),
        ("local", HIT, None, system_tokens + 50, 8 * 16),
    ], got
    assert system_tokens + 50 < HOSTED_MIN_TOKENS
    first = dict(roots[0].attributes or {})
    assert first[f"{sc.PROMPT_REGION_TOKENS}.system"] == system_tokens
    assert first[sc.PROMPT_SHARED_PREFIX] == 0

    counted = {
        (
            p.attributes[sc.ROUTE],
            p.attributes[sc.CACHE_CLASS],
            p.attributes.get(sc.PROMPT_VERSION),
            p.attributes.get(sc.CACHE_CHANGED_REGION),
            p.attributes.get(sc.REQUEST_MODEL),
        ): p.value
        for p in telemetry.metrics()[sc.METRIC_CACHE_REQUESTS]
    }
    assert counted == {
        ("roomy", COLD, "a", None, "llmtap-sim"): 1,
        ("roomy", MISS_CHANGED, "b", "system", "llmtap-sim"): 1,
        ("roomy", HIT, "a", None, "llmtap-sim"): 1,
        ("tiny", COLD, "a", None, "llmtap-sim"): 1,
        ("tiny", MISS_CHANGED, "b", "system", "llmtap-sim"): 1,
        ("tiny", MISS_EVICTED, "a", None, "llmtap-sim"): 1,
        ("hosted", TOO_SHORT, "a", None, "llmtap-sim"): 1,
        ("local", HIT, "a", None, "llmtap-sim"): 1,
    }
