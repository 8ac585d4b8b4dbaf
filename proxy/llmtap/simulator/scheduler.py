"""Continuous batching: a fixed number of running slots, a FIFO waiting line, prefill then decode.

Timing model (per admitted request):
  * prefill takes ``prefill_base_s + uncached_tokens / prefill_tokens_per_s`` and yields the first
    token, as a real engine's prefill pass does; so TTFT = queue + prefill;
  * every further token takes ``decode_s_per_token * (1 + batch_slowdown * (running - 1))``, with
    ``running`` read at the start of each chunk;
  * the first token goes out alone, then one chunk per ``stream_interval`` tokens (the last may carry
    fewer), like vLLM's ``--stream-interval``.
Every wake-up is an absolute deadline on the monotonic clock (previous deadline + step, never
now + step), so a late wake-up does not push later tokens back and the error never accumulates.
A cancelled request (the client left) gives its slot back at once, in ``finally``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from llmtap.simulator.cache import CacheHit, PrefixCache
from llmtap.simulator.profiles import Profile
from llmtap.simulator.truth import RequestRecord

__all__ = ["Engine", "Job"]


@dataclass(frozen=True, slots=True)
class Job:
    """One generation to run: the prompt's size and block hashes, and how many tokens to write."""

    prompt_tokens: int
    block_hashes: Sequence[bytes]
    output_tokens: int


class JobOutput(Protocol):
    """Where a running job's output goes (a protocol writer bound to one response)."""

    async def admitted(self, hit: CacheHit) -> None:
        """The job holds a slot and knows its cached tokens; prefill starts now."""
        ...

    async def tokens(self, start: int, end: int) -> None:
        """Tokens ``start`` to ``end`` (exclusive) are ready; ``end`` equal to the job's length is the last."""
        ...


async def sleep_until(deadline: float) -> None:
    """Sleep until the monotonic clock reads ``deadline``; an event loop may wake a timer early."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(left)


class Engine:
    """The batch: admits jobs into ``max_num_seqs`` slots in arrival order and times their output."""

    def __init__(self, profile: Profile, cache: PrefixCache) -> None:
        self.profile = profile
        self.cache = cache
        self.running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """Jobs in the FIFO line for a slot."""
        return len(self._waiting)

    async def _admit(self) -> None:
        if self.running < self.profile.max_num_seqs and not self._waiting:
            self.running += 1
            return
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(slot)
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                # The slot was handed over in the same tick the waiter was cancelled: pass it on.
                self._release()
            else:
                self._waiting.remove(slot)
            raise

    def _release(self) -> None:
        # A freed slot goes straight to the head of the line, so ``running`` does not dip and a
        # later arrival cannot jump the queue between release and wake-up.
        while self._waiting:
            slot = self._waiting.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self.running -= 1

    async def run(self, job: Job, record: RequestRecord, sink: JobOutput) -> None:
        """Wait for a slot, prefill, decode; note every step in ``record``. Cancellation frees the slot."""
        waited = self.running >= self.profile.max_num_seqs or bool(self._waiting)
        record.joined = time.monotonic()
        await self._admit()
        try:
            record.admitted = admitted = time.monotonic()
            hit = self.cache.lookup(job.block_hashes, job.prompt_tokens)
            record.cached_tokens = hit.cached_tokens
            await sink.admitted(hit)
            # Reading a prompt includes tokenizing it: a request that got a slot at once starts its
            # prefill clock at arrival, so clients see the profile's read time, not read + tokenize.
            start = admitted if waited else min(record.arrival, admitted)
            record.prefill_plan_s = self.profile.prefill_s(job.prompt_tokens - hit.cached_tokens)
            deadline = max(start + record.prefill_plan_s, admitted)
            await sleep_until(deadline)
            # The prompt's blocks are in the KV cache once its prefill is done, ready for the next request.
            self.cache.insert(job.block_hashes)
            done = 0
            size = 1  # the first token goes out on its own: it ends TTFT
            while done < job.output_tokens:
                end = min(done + size, job.output_tokens)
                if done:
                    deadline += (end - done) * self.profile.decode_step_s(self.running)
                    await sleep_until(deadline)
                record.add_chunk(time.monotonic(), end - done, deadline)
                await sink.tokens(done, end)
                done, size = end, self.profile.stream_interval
        finally:
            self._release()
