"""``provider_for`` remembers its answers by method and path, within a bound, and answers as asking every provider."""

from __future__ import annotations

import llmtap.providers as providers
from llmtap.providers import CHOSEN_MAX, PROVIDERS, provider_for

CASES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/openai/v1/chat/completions/"),
    ("POST", "/v1/embeddings"),
    ("POST", "/api/embeddings"),
    ("POST", "/api/embed"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/threads/t1/messages"),
    ("POST", "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse"),
    ("POST", "/v1/projects/p/locations/l/publishers/google/models/g:generateContent"),
    ("GET", "/v1/chat/completions"),
    ("post", "/v1/responses"),
    ("POST", "/v1/models"),
]


def _asking_each(method: str, path: str) -> object:
    return next((p for p in PROVIDERS if p.matches(method, path)), None)


def test_the_remembered_answer_is_the_one_every_provider_gives() -> None:
    providers._CHOSEN.clear()
    for _ in range(2):  # first asked, then remembered
        for method, path in CASES:
            assert provider_for(method, path) is _asking_each(method, path), (method, path)
    assert len(providers._CHOSEN) == len(CASES)


def test_paths_that_differ_each_time_hold_no_more_than_the_bound() -> None:
    providers._CHOSEN.clear()
    for i in range(3 * CHOSEN_MAX):
        path = f"/v1beta/models/m{i}:generateContent"
        assert provider_for("POST", path) is _asking_each("POST", path)
        assert len(providers._CHOSEN) <= CHOSEN_MAX
    # A very long path is answered, not kept.
    long = "/x" * 1000 + "/v1/chat/completions"
    providers._CHOSEN.clear()
    assert provider_for("POST", long) is _asking_each("POST", long) is not None
    assert not providers._CHOSEN
