"""Cache diagnosis: why a request was or was not served from the upstream's prompt cache.

The expected cacheable prefix (what the request shares with recent requests to the same upstream and
model, ``llmtap.analysis.fingerprint``) is set next to the cached tokens the server reported, and the request
gets one class:

* ``hit``: the server reported cached tokens;
* ``cold``: no earlier request to this upstream and model is remembered;
* ``miss_changed``: earlier requests exist but the prompt differs from all of them early; the region
  where it first differs is named (``tools``, ``system``, ``m0``.., ``rest``);
* ``miss_evicted``: the prompt starts with a prefix an earlier request had sent, long enough to be
  cached, yet nothing was read from the cache: evicted, or its TTL lapsed;
* ``too_short``: the prompt is shorter than the least the server caches;
* ``unknown``: the server reported no cached-token count, or the prompt could not be read.

Runs on the recorder's worker thread (it counts tokens).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from llmtap.analysis import tokens
from llmtap.analysis.fingerprint import (
    PREFIX_BLOCKS,
    SHARED_LINKS,
    Fingerprint,
    PrefixIndex,
    PrefixMatch,
    TokenCounts,
    chain_digests,
    fingerprint,
)
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.config.types import Route
from llmtap.wire.lessons import Prefix

__all__ = [
    "BLOCK_MIN_TOKENS",
    "COLD",
    "HIT",
    "HOSTED_MIN_TOKENS",
    "MISS_CHANGED",
    "MISS_EVICTED",
    "TOO_SHORT",
    "UNKNOWN",
    "CacheDiagnoser",
    "Diagnosis",
    "classify",
    "min_cacheable_tokens",
    "self_hosted",
    "site_address",
]

HIT, COLD, MISS_CHANGED, MISS_EVICTED, TOO_SHORT, UNKNOWN = (
    "hit",
    "cold",
    "miss_changed",
    "miss_evicted",
    "too_short",
    "unknown",
)
CLASSES = (HIT, COLD, MISS_CHANGED, MISS_EVICTED, TOO_SHORT, UNKNOWN)

#: Servers whose prefix cache works in blocks of tokens: one full block (vLLM's default ``--block-size``
#: on GPUs is 16) is the least they cache.
SELF_HOSTED = frozenset({"vllm", "sglang", "tgi", "llama.cpp", "ollama", "lmdeploy", "trtllm", "llmtap-sim"})
BLOCK_MIN_TOKENS = 16
#: OpenAI and Anthropic cache prompts of 1,024 tokens and more (Anthropic's smaller models need more:
#: set ``cache_min_tokens`` on their route).
HOSTED_MIN_TOKENS = 1024
#: Host names that only resolve inside a site: a Kubernetes service (``vllm.ml.svc.cluster.local``), mDNS.
_SITE_SUFFIXES = (".svc", ".svc.cluster.local", ".cluster.local", ".local", ".internal", ".localhost")


def min_cacheable_tokens(route: Route | None) -> int:
    """The shortest prompt the route's upstream caches: configured, else by the kind of server (``self_hosted``)."""
    if route is None:
        return HOSTED_MIN_TOKENS
    if route.cache_min_tokens is not None:
        return route.cache_min_tokens
    return BLOCK_MIN_TOKENS if self_hosted(route) else HOSTED_MIN_TOKENS


def self_hosted(route: Route) -> bool:
    """Whether the route's upstream is a server run on the user's own machines (a block-sized cache minimum).

    The route's ``provider`` decides when it is set: a self-hosted server's name (``SELF_HOSTED``) or not.
    Without one, the upstream's address does: a loopback, private (RFC 1918, RFC 4193), link-local or
    shared-address-space IP, or a name that resolves only inside a site (``localhost``, a name without dots,
    a Kubernetes service, ``.local``, ``.internal``). A hosted API is reached by a public name. A gateway
    on a private address in front of a hosted API is the case this cannot tell: name its provider, or set
    ``cache_min_tokens``."""
    if route.provider:
        return route.provider.lower() in SELF_HOSTED
    return site_address(route.host)


def site_address(host: str) -> bool:
    """Whether ``host`` (an IP or a name) can only be reached inside the user's own network."""
    name = host.strip("[]").rstrip(".").lower()
    if not name:
        return False
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return name == "localhost" or "." not in name or name.endswith(_SITE_SUFFIXES)
    return ip.is_loopback or ip.is_private or ip.is_link_local or ip in _SHARED_SPACE


#: RFC 6598's shared address space (carrier-grade NAT, some clusters' pod networks): not public either.
_SHARED_SPACE = ipaddress.ip_network("100.64.0.0/10")


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """The cache class of one request and the figures it rests on."""

    cache_class: str
    cached_tokens: int | None
    expected_prefix_tokens: int
    shared_prefix_tokens: int
    changed_region: str | None
    min_tokens: int
    fingerprint: Fingerprint | None = None


def classify(
    *, input_tokens: int | None, cached_tokens: int | None, match: PrefixMatch | None, min_tokens: int
) -> tuple[str, int]:
    """The class and the expected cacheable prefix (tokens) of one request; pure, for the recorder and tests."""
    shared = match.shared_tokens if match is not None else 0
    expected = shared if shared >= min_tokens else 0
    if input_tokens is not None:
        # The last prompt token is always computed: its forward pass yields the first output token.
        expected = min(expected, max(input_tokens - 1, 0))
    if cached_tokens is not None and cached_tokens > 0:
        return HIT, expected
    if input_tokens is not None and input_tokens < min_tokens:
        return TOO_SHORT, expected
    if cached_tokens is None or match is None:
        return UNKNOWN, expected
    if expected > 0:
        return MISS_EVICTED, expected
    return (MISS_CHANGED if match.known else COLD), expected


class CacheDiagnoser:
    """Fingerprints each finished request, matches it against recent ones and classifies it; one per recorder."""

    def __init__(self, routes: Iterable[Route], *, capacity: int = PREFIX_BLOCKS) -> None:
        self._routes = {r.name: r for r in routes}
        self._index = PrefixIndex(capacity)
        self._counts = TokenCounts()
        #: Where several telemetry processes share an upstream's requests: each prompt this one indexes, as
        #: a ``Prefix`` lesson for the others to ``learn`` (None: nobody to tell).
        self.learned: list[Prefix] | None = None

    def learn(self, lesson: Prefix) -> None:
        """A prompt another telemetry process indexed (``learned``, checked as it was decoded,
        ``llmtap.wire.lessons``); ``ValueError`` for anything else."""
        if type(lesson) is not Prefix:
            raise ValueError(f"not a prefix lesson: {type(lesson).__name__}")
        self._index.add_chain(lesson.digests, float(lesson.ready))

    def diagnose(self, tl: Timeline, s: Summary) -> Diagnosis | None:
        """The diagnosis of one LLM request (None for plain relays); updates the index of recent prompts."""
        req = tl.request
        if tl.protocol is None or req is None:
            return None
        min_tokens = min_cacheable_tokens(self._routes.get(tl.route))
        fp: Fingerprint | None = None
        match: PrefixMatch | None = None
        if req.regions:
            scope = f"{tl.upstream}\x00{req.model or tl.response_model or ''}"
            encoding = tokens.encoding_for_model(tl.response_model or req.model)
            fp = fingerprint(req.regions, scope=scope, encoding=encoding, counts=self._counts)
            match = self._index.match(fp, tl.sent if tl.sent is not None else tl.received)
            if tl.first_content is not None:
                # The prefill is over once the first token is out: from then on the server holds the prefix.
                self._index.add(fp, tl.first_content)
                if self.learned is not None:
                    self.learned.append(Prefix(tuple(chain_digests(fp, SHARED_LINKS)), tl.first_content))
        cache_class, expected = classify(
            input_tokens=s.input_tokens, cached_tokens=s.cache_read_tokens, match=match, min_tokens=min_tokens
        )
        return Diagnosis(
            cache_class=cache_class,
            cached_tokens=s.cache_read_tokens,
            expected_prefix_tokens=expected,
            shared_prefix_tokens=match.shared_tokens if match is not None else 0,
            changed_region=match.diverged if match is not None and match.known else None,
            min_tokens=min_tokens,
            fingerprint=fp,
        )
