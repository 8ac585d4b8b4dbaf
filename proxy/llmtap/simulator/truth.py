"""The simulator's own truth per request, kept in bounded memory, and its Prometheus rendering.

All timestamps come from ``time.monotonic()``, which on Linux is the system-wide CLOCK_MONOTONIC, so
a proxy or a test on the same machine can compare its own monotonic readings with these directly.
``arrival`` is when the request reached the app; ``queue_s`` (arrival to admitted) therefore holds
reading and tokenizing the request as well as waiting for a slot, as a real server's queue time does;
``prefill_s`` runs from admission to the first token and ``decode_s`` from the first token to the last.
A request admitted at once starts its prefill clock at arrival, so for it ``queue_s + prefill_s`` is the
profile's read time.
Beside what happened, each record keeps what the engine planned: ``prefill_plan_s``, the profile's prefill
for the prompt's uncached tokens, and ``chunk_due``, the deadline each chunk was written at or after. The
actual times are never earlier than the plan; by how much they are later is the machine's doing (a busy
event loop wakes late), so a check of the simulator's schedule reads the plan, and a check of its
promptness compares the two.
Records are kept (and numbered by ``seq``) when a request finishes.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["RequestRecord", "TruthLog", "render_metrics"]

Outcome = Literal["ok", "cancelled", "error"]


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request, as the server saw it (monotonic seconds; None = never reached)."""

    id: str
    route: str
    arrival: float
    model: str | None = None
    stream: bool = False
    status: int = 200
    outcome: Outcome = "ok"
    error: str | None = None
    #: When it joined the scheduler's line, after its body was read and its prompt tokenized.
    joined: float | None = None
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    max_tokens: int = 0
    output_tokens: int = 0
    #: The profile's prefill for the uncached tokens: what the first token's deadline was set from.
    prefill_plan_s: float | None = None
    seq: int = 0
    # When each chunk of tokens was due and when it was written, and how many tokens it carried.
    chunk_due: array[float] = field(default_factory=lambda: array("d"))
    chunk_times: array[float] = field(default_factory=lambda: array("d"))
    chunk_tokens: array[int] = field(default_factory=lambda: array("I"))

    def add_chunk(self, at: float, n_tokens: int, due: float) -> None:
        """Note a chunk of ``n_tokens`` due at ``due`` and written at ``at``."""
        if self.first_token is None:
            self.first_token = at
        self.last_token = at
        self.output_tokens += n_tokens
        self.chunk_due.append(due)
        self.chunk_times.append(at)
        self.chunk_tokens.append(n_tokens)

    def as_json(self) -> dict[str, Any]:
        """The record as the debug endpoint shows it; durations in seconds, chunk offsets from arrival."""

        def span(start: float | None, end: float | None) -> float | None:
            return None if start is None or end is None else round(end - start, 6)

        return {
            "seq": self.seq,
            "id": self.id,
            "route": self.route,
            "model": self.model,
            "stream": self.stream,
            "status": self.status,
            "outcome": self.outcome,
            "error": self.error,
            "arrival": self.arrival,
            "joined": self.joined,
            "admitted": self.admitted,
            "first_token": self.first_token,
            "last_token": self.last_token,
            "queue_s": span(self.arrival, self.admitted),
            "prefill_s": span(self.admitted, self.first_token),
            "decode_s": span(self.first_token, self.last_token),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "max_tokens": self.max_tokens,
            "output_tokens": self.output_tokens,
            "prefill_plan_s": self.prefill_plan_s,
            "chunk_due_offsets_s": [round(t - self.arrival, 6) for t in self.chunk_due],
            "chunk_offsets_s": [round(t - self.arrival, 6) for t in self.chunk_times],
            "chunk_tokens": list(self.chunk_tokens),
        }


class TruthLog:
    """The most recent finished requests, numbered in the order they finished, plus running totals."""

    def __init__(self, capacity: int) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=capacity)
        self._seq = 0
        self.outcomes: dict[str, int] = {"ok": 0, "cancelled": 0, "error": 0}
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0

    @property
    def last_seq(self) -> int:
        """Sequence number of the latest finished request (0 before any)."""
        return self._seq

    def finish(self, record: RequestRecord) -> None:
        """Number and keep a finished record, and add it to the totals."""
        self._seq += 1
        record.seq = self._seq
        self._records.append(record)
        self.outcomes[record.outcome] += 1
        self.prompt_tokens += record.prompt_tokens
        self.cached_tokens += record.cached_tokens
        self.output_tokens += record.output_tokens

    def since(self, seq: int, limit: int | None = None) -> list[RequestRecord]:
        """Kept records numbered above ``seq``, oldest first; at most the ``limit`` most recent."""
        found = [r for r in self._records if r.seq > seq]
        return found[-limit:] if limit else found


def render_metrics(log: TruthLog, *, model: str, running: int, waiting: int, cache_blocks: int) -> str:
    """Prometheus text exposition (format 0.0.4) of the simulator's gauges and counters."""
    label = f'model_name="{model}"'
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, int]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {value}" for labels, value in samples)

    family("llmtap_sim_num_requests_running", "gauge", "Requests holding a batch slot.", [(label, running)])
    family("llmtap_sim_num_requests_waiting", "gauge", "Requests waiting for a batch slot.", [(label, waiting)])
    family(
        "llmtap_sim_requests_total",
        "counter",
        "Finished requests by outcome (ok, cancelled, error).",
        [(f'{label},outcome="{k}"', v) for k, v in log.outcomes.items()],
    )
    family(
        "llmtap_sim_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [(label, log.prompt_tokens)]
    )
    family(
        "llmtap_sim_cached_tokens_total",
        "counter",
        "Prompt tokens read from the prefix cache.",
        [(label, log.cached_tokens)],
    )
    family("llmtap_sim_generation_tokens_total", "counter", "Output tokens written.", [(label, log.output_tokens)])
    family("llmtap_sim_prefix_cache_blocks", "gauge", "Blocks held by the prefix cache.", [(label, cache_blocks)])
    return "\n".join(lines) + "\n"
