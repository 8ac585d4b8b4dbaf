"""What identifies a prompt: per-region fingerprints, the prefix it shares with recent requests, its version.

A prompt is cut into regions in the order servers cache it (Anthropic's prompt-caching order, which
OpenAI and vLLM's automatic prefix caching follow too): ``tools``, ``system``, the first messages ``m0``
to ``m3``, and ``rest``. Each region gets a short sha256 and its token length, so a trace shows which
part of a prompt changed between two requests without showing the prompt.

To find the longest prefix a request shares with recent requests to the same upstream and model, the
prompt's parts are also cut into blocks of a few hundred tokens whose hashes chain from the start of
the prompt (the way a server's prefix cache keys its blocks), and a bounded LRU index remembers the
chains it saw. Everything here runs on the recorder's worker thread, never on the event loop.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from llmtap.analysis import tokens
from llmtap.providers.openai_common import collect_text
from llmtap.types import PromptRegion

__all__ = [
    "BLOCK_CHARS",
    "PART_COUNTS",
    "PREFIX_BLOCKS",
    "SHARED_LINKS",
    "Fingerprint",
    "PrefixIndex",
    "PrefixMatch",
    "TokenCounts",
    "chain_digests",
    "fingerprint",
]

#: Messages after the system prompt that get a region of their own; the others share ``rest``.
FIRST_MESSAGES = 4
#: Characters per chained block: about 250 tokens of English, fine enough to place a changed sentence.
BLOCK_CHARS = 1024
#: Hex digits of a region's hash shown on spans and records (48 bits: collisions are not a concern
#: among the handful of variants one prompt goes through).
SHORT_HASH = 12


@dataclass(frozen=True, slots=True)
class Region:
    """One region of a prompt: its name (``tools``, ``system``, ``m0``.., ``rest``), short hash and tokens."""

    name: str
    digest: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Link:
    """One chained block: the hash of the prompt up to its end, the tokens up to there, its region."""

    digest: bytes
    tokens: int
    region: str


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A prompt's regions and its block chain, rooted in the upstream and model it was sent to."""

    regions: tuple[Region, ...]
    root: bytes
    chain: tuple[Link, ...]

    @property
    def tokens(self) -> int:
        """The prompt's counted tokens (tiktoken; a chat template adds a few that are not here)."""
        return sum(r.tokens for r in self.regions)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a prompt recent requests to the same upstream and model already sent.

    ``known`` is False when no earlier request to that upstream and model is remembered (a cold start);
    ``diverged`` names the region where the prompt first differs from every remembered one, or None
    when the whole prompt was seen before or nothing is known.
    """

    shared_tokens: int
    known: bool
    diverged: str | None


def region_name(kind: str, message_index: int) -> str:
    """The region a prompt part belongs to: tools, system, ``m0`` to ``m3``, or ``rest``."""
    if kind in ("tools", "system"):
        return kind
    return f"m{message_index}" if message_index < FIRST_MESSAGES else "rest"


def _serialize(part: PromptRegion) -> str:
    # What the client sent, as sent (key order kept: a template renders it in that order).
    if isinstance(part.value, str):
        return part.value
    return json.dumps(part.value, ensure_ascii=False, separators=(",", ":"), default=str)


def _text(part: PromptRegion, serialized: str) -> str:
    # The text the model reads: tool schemas are read as JSON, messages as their text pieces.
    if part.kind == "tools" or isinstance(part.value, str):
        return serialized
    out: list[str] = []
    collect_text(part.value, out)
    return "\n".join(out)


#: Prompt parts whose token count is remembered (by content hash) at most; the least recently used goes first.
PART_COUNTS = 4096
#: Prefix blocks the index of recent prompts holds at most (a 16-byte hash and a time each, about 150 bytes with
#: the table's share); the least recently used goes first.
PREFIX_BLOCKS = 65536


class TokenCounts:
    """Token counts of prompt parts by content hash, so a long system prompt sent again is not recounted."""

    def __init__(self, capacity: int = PART_COUNTS) -> None:
        self._capacity = capacity
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def count(self, key: bytes, text: str, encoding: str) -> int:
        """Tokens in ``text``, remembered under ``key`` (a hash of the part and the encoding)."""
        n = self._counts.get(key)
        if n is None:
            n = tokens.count(text, encoding)
            self._counts[key] = n
            if len(self._counts) > self._capacity:
                self._counts.popitem(last=False)
        else:
            self._counts.move_to_end(key)
        return n


def root_digest(scope: str) -> bytes:
    """The chain's root for one upstream and model: prompts sent elsewhere never share a prefix."""
    return hashlib.sha256(b"llmtap-prefix\x00" + scope.encode("utf-8", "surrogatepass")).digest()[:16]


def fingerprint(
    parts: Sequence[PromptRegion], *, scope: str, encoding: str, counts: TokenCounts | None = None
) -> Fingerprint:
    """Hash and count a prompt's parts (call it off the event loop: it tokenizes)."""
    counts = counts or TokenCounts()
    root = root_digest(scope)
    chain: list[Link] = []
    region_digests: dict[str, list[bytes]] = {}
    region_tokens: dict[str, int] = {}
    prev, total, message = root, 0, 0
    for part in parts:
        name = region_name(part.kind, message)
        if part.kind not in ("tools", "system"):
            message += 1
        serialized = _serialize(part)
        data = part.kind.encode() + b"\x00" + serialized.encode("utf-8", "surrogatepass")
        digest = hashlib.sha256(data).digest()
        n = counts.count(digest + encoding.encode(), _text(part, serialized), encoding)
        region_digests.setdefault(name, []).append(digest)
        region_tokens[name] = region_tokens.get(name, 0) + n
        # Blocks restart at every part, so an edit in one message leaves the blocks of the others intact.
        size = max(len(serialized), 1)
        for start in range(0, size, BLOCK_CHARS):
            end = min(start + BLOCK_CHARS, size)
            block = part.kind.encode() + b"\x00" + serialized[start:end].encode("utf-8", "surrogatepass")
            prev = hashlib.sha256(prev + block).digest()[:16]
            chain.append(Link(prev, total + round(n * end / size), name))
        total += n
    regions = tuple(
        Region(name, hashlib.sha256(b"".join(digests)).hexdigest()[:SHORT_HASH], region_tokens[name])
        for name, digests in region_digests.items()
    )
    return Fingerprint(regions=regions, root=root, chain=tuple(chain))


#: Blocks of a prompt's chain another telemetry process is told at most (its head: 4 MB of prompt, 64 KB of hashes).
SHARED_LINKS = 4096


def chain_digests(fp: Fingerprint, limit: int | None = None) -> list[bytes]:
    """``fp``'s block hashes as ``PrefixIndex.add_chain`` takes them: tail first, so a prompt's head is the most
    recent and is evicted last, as servers do; ``limit``: the head's blocks only."""
    links = fp.chain if limit is None else fp.chain[:limit]
    return [*(link.digest for link in reversed(links)), fp.root]


class PrefixIndex:
    """The block chains of recent prompts, LRU-bounded, each with the time its prefix became cacheable.

    A request can only find in a server's cache what an earlier request's prefill had finished
    writing before it was sent, so ``match`` takes that moment and ignores younger entries: two
    identical requests sent together are both cold, as they are on the server. Used by one thread.
    """

    def __init__(self, capacity: int = PREFIX_BLOCKS) -> None:
        self._capacity = capacity
        self._ready: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ready)

    def _seen(self, digest: bytes, before: float) -> bool:
        ready = self._ready.get(digest)
        return ready is not None and ready <= before

    def match(self, fp: Fingerprint, before: float) -> PrefixMatch:
        """The longest prefix of ``fp`` that prompts cacheable before ``before`` shared."""
        if not self._seen(fp.root, before):
            return PrefixMatch(shared_tokens=0, known=False, diverged=None)
        shared = 0
        for link in fp.chain:
            if not self._seen(link.digest, before):
                return PrefixMatch(shared_tokens=shared, known=True, diverged=link.region)
            shared = link.tokens
        return PrefixMatch(shared_tokens=shared, known=True, diverged=None)

    def add(self, fp: Fingerprint, ready: float) -> None:
        """Remember ``fp`` as cacheable from ``ready`` (its prefill's end) on; evicts the least recent."""
        self.add_chain(chain_digests(fp), ready)

    def add_chain(self, digests: Sequence[bytes], ready: float) -> None:
        """Remember a prompt's block chain (``chain_digests``: its tail first, its root last) as cacheable from
        ``ready`` on; how another telemetry process's prompt joins this index."""
        for digest in digests:
            known = self._ready.get(digest)
            self._ready[digest] = ready if known is None else min(known, ready)
            self._ready.move_to_end(digest)
        while len(self._ready) > self._capacity:
            self._ready.popitem(last=False)
