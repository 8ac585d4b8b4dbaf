"""Prompt fingerprints: regions, hashes and token lengths, the shared prefix, version labels and their top-K."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from llmtap.analysis import tokens
from llmtap.analysis.fingerprint import BLOCK_CHARS, PrefixIndex, TokenCounts, fingerprint
from llmtap.config.types import Route, Settings
from llmtap.labels import INVALID_VERSION, version_label
from llmtap.providers import AnthropicMessages, OpenAIChat, OpenAICompletions, OpenAIResponses
from llmtap.simulator import get_profile, run_in_thread
from llmtap.telemetry import semconv as sc
from llmtap.types import PromptRegion
from tests.conftest import Telemetry

SYSTEM = "You are the support assistant of a bank. " * 40
TOOLS = [{"type": "function", "function": {"name": "balance", "parameters": {"type": "object"}}}]
SCOPE = "http://upstream:8000\x00model"


def chat(system: str, *users: str, tools: list[Any] | None = None) -> list[PromptRegion]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, *({"role": "user", "content": u} for u in users)],
    }
    if tools:
        body["tools"] = tools
    return OpenAIChat().inspect(json.dumps(body).encode(), inject_usage=False).regions


def test_regions_hash_and_count_each_part() -> None:
    users = [f"question {i}: where is my card?" for i in range(6)]
    fp = fingerprint(chat(SYSTEM, *users, tools=TOOLS), scope=SCOPE, encoding="o200k_base")
    names = [r.name for r in fp.regions]
    assert names == ["tools", "system", "m0", "m1", "m2", "m3", "rest"]
    by_name = {r.name: r for r in fp.regions}
    assert by_name["system"].tokens == tokens.count(SYSTEM)
    assert by_name["m0"].tokens == tokens.count(users[0])
    assert by_name["rest"].tokens == tokens.count(users[4]) + tokens.count(users[5])
    assert by_name["tools"].tokens == tokens.count(json.dumps(TOOLS, ensure_ascii=False, separators=(",", ":")))
    assert all(len(r.digest) == 12 and int(r.digest, 16) >= 0 for r in fp.regions)
    # Only the region that changed gets another hash.
    other = fingerprint(chat(SYSTEM, "another question", *users[1:], tools=TOOLS), scope=SCOPE, encoding="o200k_base")
    changed = {r.name for r, s in zip(fp.regions, other.regions, strict=True) if r.digest != s.digest}
    assert changed == {"m0"}


def test_every_protocol_gives_its_regions_in_cache_order() -> None:
    anthropic = AnthropicMessages().inspect(
        json.dumps(
            {
                "model": "c",
                "system": [{"type": "text", "text": SYSTEM}],
                "tools": TOOLS,
                "messages": [{"role": "user", "content": "hi"}],
            }
        ).encode(),
        inject_usage=False,
    )
    assert [r.kind for r in anthropic.regions] == ["tools", "system", "message"]
    responses = OpenAIResponses().inspect(
        json.dumps({"model": "g", "instructions": SYSTEM, "input": "hi"}).encode(), inject_usage=False
    )
    assert [(r.kind, r.value) for r in responses.regions] == [("system", SYSTEM), ("message", "hi")]
    completions = OpenAICompletions().inspect(
        json.dumps({"model": "g", "prompt": ["abc", "def"]}).encode(), inject_usage=False
    )
    assert [(r.kind, r.value) for r in completions.regions] == [("message", "abc")]
    developer = OpenAIChat().inspect(
        json.dumps(
            {
                "model": "g",
                "messages": [
                    {"role": "developer", "content": "d"},
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "u"},
                ],
            }
        ).encode(),
        inject_usage=False,
    )
    assert [r.kind for r in developer.regions] == ["system", "message"]
    assert OpenAIChat().inspect(b"not json", inject_usage=False).regions == []


def test_shared_prefix_is_found_within_a_long_part() -> None:
    # Two prompts with one long system prompt that differs only near its end: the blocks before the
    # edit are shared, so the shared prefix is most of the system prompt, not zero.
    long = "".join(f"Rule {i}: answer politely and briefly. " for i in range(200))
    first = fingerprint(chat(long + "Today is Monday.", "hi"), scope=SCOPE, encoding="o200k_base")
    second = fingerprint(chat(long + "Today is Tuesday.", "hi"), scope=SCOPE, encoding="o200k_base")
    index = PrefixIndex()
    index.add(first, ready=1.0)
    match = index.match(second, before=2.0)
    system_tokens = tokens.count(long)
    assert match.known and match.diverged == "system"
    block_tokens = system_tokens * BLOCK_CHARS / len(long)
    assert system_tokens - 2 * block_tokens <= match.shared_tokens <= system_tokens, (match, system_tokens)


def test_prefix_index_waits_for_the_prefill_and_stays_bounded() -> None:
    a = fingerprint(chat(SYSTEM, "one"), scope=SCOPE, encoding="o200k_base")
    b = fingerprint(chat(SYSTEM, "two"), scope=SCOPE, encoding="o200k_base")
    index = PrefixIndex()
    cold = index.match(a, before=10.0)
    assert not cold.known and cold.shared_tokens == 0 and cold.diverged is None
    index.add(a, ready=5.0)
    # Sent before a's prefill ended: the server could not have had it either.
    assert not index.match(b, before=4.0).known
    warm = index.match(b, before=6.0)
    assert warm.known and warm.diverged == "m0"
    assert warm.shared_tokens == pytest.approx(tokens.count(SYSTEM), abs=2)
    same = index.match(a, before=6.0)
    assert same.diverged is None and same.shared_tokens == pytest.approx(a.tokens, abs=1)
    # Another model on the same upstream shares nothing.
    elsewhere = fingerprint(chat(SYSTEM, "one"), scope="http://upstream:8000\x00other", encoding="o200k_base")
    assert not index.match(elsewhere, before=6.0).known
    small = PrefixIndex(capacity=5)
    for i in range(20):
        small.add(fingerprint(chat(f"system {i}", "x"), scope=SCOPE, encoding="o200k_base"), ready=float(i))
    assert len(small) == 5


def test_token_counts_are_remembered_by_content() -> None:
    counts = TokenCounts(capacity=2)
    assert counts.count(b"k1", "hello world", "o200k_base") == 2
    # The same key is not counted again (the text is not even looked at).
    assert counts.count(b"k1", "", "o200k_base") == 2
    counts.count(b"k2", "a", "o200k_base")
    counts.count(b"k3", "a", "o200k_base")
    assert counts.count(b"k1", "", "o200k_base") == 0  # evicted, so recounted


@pytest.mark.parametrize(
    ("raw", "label"),
    [
        (None, None),
        (b"", None),
        (b"  ", None),
        (b"v2", "v2"),
        (b"support-2026-05-01 fixed-first", "support-2026-05-01 fixed-first"),
        ("prompt-é".encode(), "prompt-é"),
        (b"x" * 128, "x" * 128),
        (b"x" * 129, INVALID_VERSION),
        (b"v\t2", INVALID_VERSION),
        (b"v\x002", INVALID_VERSION),
        (b"v\x7f", INVALID_VERSION),
        (b"\xff\xfe", INVALID_VERSION),
    ],
)
def test_version_labels(raw: bytes | None, label: str | None) -> None:
    assert version_label(raw) == label


@pytest.fixture
def sim() -> Iterator[str]:
    url, stop = run_in_thread(get_profile("fast"))
    yield url
    stop()


@pytest.mark.e2e
def test_bad_version_header_is_refused_as_a_label_not_as_a_request(
    sim: str, proxy_factory: Any, telemetry: Telemetry
) -> None:
    proxy = proxy_factory(Settings(routes=(Route(prefix="/", upstream=sim, name="r", provider="llmtap-sim"),)))
    body = {"model": "llmtap-sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    versions = {"long": "v" * 200, "tab": "a\tb", "good": "v2"}
    for version in versions.values():
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={"x-llmtap-prompt-version": version})
        assert r.status_code == 200, r.text
    proxy.flush()
    roots = [s for s in telemetry.finished() if s.name.startswith("chat")]
    assert sorted(str((s.attributes or {}).get(sc.PROMPT_VERSION)) for s in roots) == [INVALID_VERSION] * 2 + ["v2"]
    # The same prompt each time: one fingerprint, with the region's token length beside it.
    assert len({(s.attributes or {})[f"{sc.PROMPT_FINGERPRINT}.m0"] for s in roots}) == 1
    assert {(s.attributes or {})[f"{sc.PROMPT_REGION_TOKENS}.m0"] for s in roots} == {tokens.count("hello")}
    # The prompt version is llmtap's label (the gen_ai.* metrics carry the conventions' attributes only).
    points = telemetry.metrics()[sc.METRIC_REQUESTS]
    assert {p.attributes.get(sc.PROMPT_VERSION) for p in points} == {INVALID_VERSION, "v2"}
