"""Timing and capacity profiles of the simulated server, calibrated on the "Inference 101" course numbers.

A profile is the whole model of one server: how fast it reads a prompt (prefill), how fast it writes
(decode), how many sequences it batches, how its prefix cache is sized and what it calls its model.
Every field can be overridden by keyword: ``get_profile("support", max_num_seqs=2)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["PROFILES", "Profile", "get_profile", "profile_table"]


@dataclass(frozen=True, slots=True)
class Profile:
    """One simulated server: timing model, batch and cache capacity, served model names."""

    name: str
    #: What the profile stands for, in a few words (``llmtap simulate --list-profiles``).
    about: str = ""
    #: Names the server answers to; the first is the canonical one (vLLM's ``--served-model-name``).
    served_models: tuple[str, ...] = ("llmtap-sim",)
    #: tiktoken encoding for prompts and generated text (shipped with the package, so offline).
    encoding: str = "o200k_base"
    #: Continuous-batching slots; further requests wait in a FIFO line (vLLM ``--max-num-seqs``).
    max_num_seqs: int = 8
    #: Prompt plus output may not exceed this (vLLM ``--max-model-len``).
    max_model_len: int = 32768
    #: Output length when the request names none.
    default_max_tokens: int = 300
    #: Prefill takes ``prefill_base_s + uncached_tokens / prefill_tokens_per_s``; the first token ends it.
    prefill_base_s: float = 0.001
    prefill_tokens_per_s: float = 7950.0
    #: Each further token takes ``decode_s_per_token * (1 + batch_slowdown * (running - 1))``.
    decode_s_per_token: float = 0.022
    batch_slowdown: float = 0.05
    #: Tokens per streamed chunk after the first (vLLM ``--stream-interval``); the last may carry fewer.
    stream_interval: int = 1
    #: Prefix-cache granularity in tokens and capacity in blocks (LRU beyond it).
    block_size: int = 16
    cache_blocks: int = 8192
    #: When True the role chunk / message_start go out at admission, before prefill ends, as hosted
    #: APIs do; so a client sees the first byte before the first token and must not confuse them.
    prelude_on_admit: bool = True
    system_fingerprint: str = "llmtap-sim-0.1"
    #: Chat chunks as OpenAI's own API writes them rather than vLLM: ``system_fingerprint`` on every chunk, and
    #: once usage is asked for, ``"usage": null`` on every chunk but the usage chunk (standards D.1).
    openai_chunks: bool = False
    #: Finished requests kept for ``GET /debug/requests`` (bounded memory).
    history: int = 1024

    def __post_init__(self) -> None:
        # Accept any iterable of names (a list from a config file) but store a hashable tuple.
        names: Any = self.served_models
        if isinstance(names, str):
            names = (names,)
        object.__setattr__(self, "served_models", tuple(names))
        if not self.served_models:
            raise ValueError("a profile serves at least one model name")
        for field_name in ("max_num_seqs", "max_model_len", "default_max_tokens", "stream_interval", "block_size"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name} must be at least 1")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        if min(self.prefill_base_s, self.decode_s_per_token, self.batch_slowdown) < 0:
            raise ValueError("times and batch_slowdown must not be negative")
        if self.cache_blocks < 0 or self.history < 1:
            raise ValueError("cache_blocks must be >= 0 and history >= 1")

    @property
    def model(self) -> str:
        """The canonical served model name."""
        return self.served_models[0]

    def prefill_s(self, uncached_tokens: int) -> float:
        """Seconds to read ``uncached_tokens`` prompt tokens, first token included."""
        return self.prefill_base_s + uncached_tokens / self.prefill_tokens_per_s

    def decode_step_s(self, running: int) -> float:
        """Seconds per output token while ``running`` sequences share the batch."""
        return self.decode_s_per_token * (1.0 + self.batch_slowdown * max(0, running - 1))

    def replace(self, **overrides: Any) -> Profile:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **overrides)


# The support assistant of the course: a 6,200-token prompt (5,250 fixed + 950 variable) read at
# 7,950 tokens/s takes 0.001 + 6200/7950 = 0.781 s; with the fixed part cached (328 blocks of 16 =
# 5,248 tokens) the 952 uncached tokens take 0.001 + 952/7950 = 0.121 s. Decode 22 ms per token:
# 300 tokens in 6.6 s, about 45 tokens/s.
SUPPORT = Profile(
    name="support",
    about="the course's support assistant: long prompts, long answers",
    max_num_seqs=8,
    max_model_len=32768,
    default_max_tokens=300,
    prefill_base_s=0.001,
    prefill_tokens_per_s=7950.0,
    decode_s_per_token=0.022,
    # Decode is memory-bound: a small batch costs a GPU step little more than one sequence.
    batch_slowdown=0.02,
    cache_blocks=8192,
)

# Code completion: a 200-token prompt reads in 0.005 + 200/10000 = 0.025 s; 64 tokens at 8 ms each
# (125 tokens/s) finish in about 0.5 s.
CODE = Profile(
    name="code",
    about="code completion: short prompts, short answers, fast decode",
    max_num_seqs=16,
    max_model_len=16384,
    default_max_tokens=64,
    prefill_base_s=0.005,
    prefill_tokens_per_s=10000.0,
    decode_s_per_token=0.008,
    batch_slowdown=0.03,
    cache_blocks=4096,
)

# Tests and benchmarks: 2 ms + 1 µs per token of prefill, 3 ms per output token, no batch slowdown,
# so timings are exact and a whole request takes tens of milliseconds.
FAST = Profile(
    name="fast",
    about="tests and benchmarks: every request in tens of milliseconds",
    max_num_seqs=4,
    max_model_len=8192,
    default_max_tokens=16,
    prefill_base_s=0.002,
    prefill_tokens_per_s=1_000_000.0,
    decode_s_per_token=0.003,
    batch_slowdown=0.0,
    cache_blocks=1024,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (SUPPORT, CODE, FAST)}


def get_profile(name: str, **overrides: Any) -> Profile:
    """The named profile, with any fields overridden by keyword."""
    try:
        base = PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
    return base.replace(**overrides) if overrides else base


def profile_table(profiles: dict[str, Profile] = PROFILES) -> str:
    """What each profile models, and its timing and capacity as its fields give them (so never stale)."""
    width = max(len(name) for name in profiles)
    lines = []
    for p in profiles.values():
        pad = " " * (width + 4)
        decode = f"{p.decode_s_per_token * 1000:g} ms/token"
        if p.decode_s_per_token:
            decode += f" ({1 / p.decode_s_per_token:.0f} tokens/s)"
        lines += [
            f"  {p.name.ljust(width)}  {p.about}",
            f"{pad}prefill {p.prefill_base_s * 1000:g} ms + {p.prefill_tokens_per_s:,.0f} tokens/s; decode {decode}, "
            f"+{p.batch_slowdown:.0%} per other stream",
            f"{pad}{p.max_num_seqs} slots; prefix cache {p.cache_blocks:,} blocks of {p.block_size} tokens; "
            f"{p.default_max_tokens} output tokens by default; context {p.max_model_len:,} tokens",
        ]
    return "\n".join(lines)
