"""Verifying a prompt change against a real vLLM with automatic prefix caching (the issue's real check).

The proxy runs in front of vLLM (CPU build, the medium model, blocks of 32 tokens) with ``--record``.
Three layouts of one prompt (a 1,024-word unchanging part, a 200-word variable part per request) go
through it one request at a time:

* ``fixed-first``: the unchanging part first; vLLM reads it from its prefix cache;
* ``variable-first``: the variable part moved first; vLLM's cached tokens drop to zero, and the
  diagnosis names the region that changed (the system prompt);
* ``fixed-again``: moved back; the cached tokens return, and ``llmtap compare`` over the records shows
  the TTFT gain with a confidence interval that excludes zero.

``pytest -s`` prints each request's figures and compare's report.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap.config.types import Records, Route, Settings, Timeouts
from llmtap.store.files import ReadStats, read_records
from tests.conftest import Telemetry, start_proxy
from tests.support.vllm_server import VllmServer, vllm_medium

pytestmark = [pytest.mark.real, pytest.mark.e2e]
__all__ = ["vllm_medium"]  # the fixture, imported so pytest finds it here

MODEL = "medium"
WORDS = ("def", "return", "self", "import", "class", "if", "else", "for", "in", "None")
FIXED_WORDS = 1024
VARIABLE_WORDS = 200
PER_LAYOUT = 5
BLOCK = 32  # --block-size of the harness: the least vLLM's CPU backend caches
LAYOUTS = ("fixed-first", "variable-first", "fixed-again")


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def drive(url: str, salt: str, words: list[int]) -> None:
    """Each layout in turn, one request at a time (a warm-up first, so each layout starts from a warm cache)."""
    rng = random.Random(salt)
    fixed = f"{salt} You answer questions about the code below. {text(rng, FIXED_WORDS)}"
    async with httpx.AsyncClient(timeout=120) as client:
        for layout in LAYOUTS:
            for i in range(PER_LAYOUT + 1):
                variable = f"{salt} {layout} request {i}: {text(rng, VARIABLE_WORDS)}"
                first, second = (variable, fixed) if layout == "variable-first" else (fixed, variable)
                body = {
                    "model": MODEL,
                    "messages": [{"role": "system", "content": first}, {"role": "user", "content": second}],
                    "stream": True,
                    "max_tokens": 4,
                    "ignore_eos": True,
                    # Whole words only: a lone UTF-8 byte would be held back and delay the visible first token.
                    "allowed_token_ids": words,
                }
                version = "warmup" if i == 0 else layout
                headers = {"x-llmtap-prompt-version": version}
                async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status_code == 200, await r.aread()
                    await r.aread()


@pytest.fixture(scope="module")
def records(vllm_medium: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("vllm-cache") / "records"
    route = Route(prefix="/", upstream=vllm_medium.url, name="vllm", provider="vllm", cache_min_tokens=BLOCK)
    settings = Settings(routes=(route,), timeouts=Timeouts(read=120), record=Records(path=str(path)))
    telemetry = Telemetry()
    running, threads = start_proxy(settings, telemetry)
    try:
        words = sorted(set(vllm_medium.tokenize(" " + " ".join(WORDS))))
        # The salt starts every prompt, so nothing another test put in vLLM's cache matches.
        asyncio.run(drive(running.url, f"cache {os.urandom(4).hex()}", words))
        running.flush()
    finally:
        for thread in reversed(threads):
            thread.__exit__(None, None, None)
        telemetry.tracer_provider.shutdown()
        telemetry.meter_provider.shutdown()
    yield path


def by_layout(path: Path) -> dict[str, list[dict[str, Any]]]:
    stats = ReadStats()
    out: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
    for rec in read_records(path, stats):
        if rec["prompt_version"] in out:
            out[rec["prompt_version"]].append(rec)
    assert stats.skipped == 0 and all(len(v) == PER_LAYOUT for v in out.values()), stats
    print("\nlayout          input cached expected class         region   TTFT")
    for layout, recs in out.items():
        for r in recs:
            c = r["cache"]
            print(
                f"{layout:15} {r['tokens']['input']:5} {c['cached_tokens']:6} {c['expected_prefix_tokens']:8} "
                f"{c['class']:13} {c['changed_region'] or '-':8} {r['ttft'] * 1000:5.0f} ms"
            )
    return out


def test_moving_the_variable_part_first_drops_the_cache_and_names_the_region(records: Path) -> None:
    layouts = by_layout(records)
    for rec in layouts["fixed-first"] + layouts["fixed-again"]:
        cache = rec["cache"]
        # vLLM reads the unchanging part (and the chat template before it) from its cache, in whole blocks.
        assert cache["class"] == "hit" and cache["cached_tokens"] >= FIXED_WORDS - BLOCK, cache
        assert cache["cached_tokens"] % BLOCK == 0
        assert cache["expected_prefix_tokens"] >= FIXED_WORDS - BLOCK, cache
    for rec in layouts["variable-first"]:
        cache = rec["cache"]
        assert cache["cached_tokens"] == 0, cache  # what vLLM itself reported
        assert (cache["class"], cache["changed_region"], cache["expected_prefix_tokens"]) == (
            "miss_changed",
            "system",
            0,
        )


def test_compare_shows_the_gain_of_moving_it_back(records: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "llmtap",
        "compare",
        str(records),
        "--before",
        "variable-first",
        "--after",
        "fixed-again",
    ]
    root = Path(__file__).parents[2]
    report = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=root)
    assert report.returncode == 0, report.stderr
    print(report.stdout)
    out = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=60, cwd=root)
    data = json.loads(out.stdout)
    assert data["kind"] == "gain" and data["verdict"].startswith("caching gain: TTFT p50"), data["verdict"]
    assert data["verdict"] in report.stdout.splitlines()  # the text says the same verdict, on a line of its own
    change = data["change"]["ttft_p50"]
    assert change["seconds"]["high"] < 0 and change["relative"]["high"] < 0  # the interval excludes zero
    assert data["before"]["cached_share"] == 0 and data["after"]["cached_share"] > 0.6
