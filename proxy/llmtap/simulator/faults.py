"""Faults real servers have, played on request: a 5xx, a stream that dies midway, a slow first byte.

Tests and soaks need the failures a proxy meets in production without a real server failing. A request asks
for one in the ``x-sim-fault`` header (a name llmtap forwards upstream; its own ``X-Llmtap-*`` headers it does
not), and ``llmtap simulate --fault SPEC --fault-rate P`` plays ``SPEC`` on a share ``P`` of all requests. A
spec is ``;``-separated ``key=value`` terms:

* ``status=503``: the answer is that status (500 to 599), with the protocol's error body, before any work;
* ``cut-after=3``: a stream's connection is dropped after its first 3 chunks of tokens, with no end of body
  (no ``[DONE]``, no ``message_stop``, no closing chunk of the chunked encoding), as a crashed worker leaves it;
* ``first-byte-delay=1.5``: seconds before anything is sent, headers included (a slow or overloaded front end).

Terms combine (``first-byte-delay=2;cut-after=5``). A spec that does not parse is a 400 naming the term, so a
test that asks for a fault it cannot get learns why.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from llmtap.simulator.requests import SimError

__all__ = ["FAULT_HEADER", "Fault", "FaultPlan", "parse_fault"]

#: The request header that asks for a fault.
FAULT_HEADER = b"x-sim-fault"
#: The longest delay a spec may ask for: a slow first byte, not a hung server.
MAX_DELAY_S = 600.0


@dataclass(frozen=True, slots=True)
class Fault:
    """What to do wrong with one request; None fields do nothing."""

    status: int | None = None
    cut_after: int | None = None
    first_byte_delay: float | None = None

    def describe(self) -> str:
        """The fault in the spec's own words, for the truth log."""
        terms = [
            f"status={self.status}" if self.status is not None else "",
            f"cut-after={self.cut_after}" if self.cut_after is not None else "",
            f"first-byte-delay={self.first_byte_delay:g}" if self.first_byte_delay is not None else "",
        ]
        return ";".join(t for t in terms if t)


def _bad(term: str, why: str) -> SimError:
    return SimError(400, f"{FAULT_HEADER.decode()}: {term!r}: {why}", param=FAULT_HEADER.decode())


def _term(key: str, value: str, term: str) -> tuple[str, float | int]:
    try:
        if key == "status":
            status = int(value)
            if not 500 <= status <= 599:
                raise _bad(term, "status must be 500 to 599")
            return "status", status
        if key == "cut-after":
            chunks = int(value)
            if chunks < 0:
                raise _bad(term, "cut-after must be 0 or more chunks")
            return "cut_after", chunks
        if key == "first-byte-delay":
            delay = float(value)
            if not 0.0 <= delay <= MAX_DELAY_S:
                raise _bad(term, f"first-byte-delay must be 0 to {MAX_DELAY_S:g} seconds")
            return "first_byte_delay", delay
    except ValueError:
        raise _bad(term, "not a number") from None
    raise _bad(term, "known keys: status, cut-after, first-byte-delay")


def parse_fault(spec: str) -> Fault:
    """The fault a spec names; ``SimError`` (400) for a spec that does not parse."""
    fields: dict[str, float | int] = {}
    for term in spec.split(";"):
        term = term.strip()
        if not term:
            continue
        key, sep, value = term.partition("=")
        if not sep:
            raise _bad(term, "a term is key=value")
        name, parsed = _term(key.strip().lower(), value.strip(), term)
        fields[name] = parsed
    return Fault(
        status=int(fields["status"]) if "status" in fields else None,
        cut_after=int(fields["cut_after"]) if "cut_after" in fields else None,
        first_byte_delay=float(fields["first_byte_delay"]) if "first_byte_delay" in fields else None,
    )


class FaultPlan:
    """Which fault a request gets: the one its header asks for, else the server's own at its rate."""

    def __init__(self, fault: Fault | None = None, rate: float = 0.0, seed: int | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError("the fault rate is a share of requests, 0 to 1")
        self.fault, self.rate = fault, rate
        self._rng = random.Random(seed)

    def for_request(self, header: bytes | None) -> Fault | None:
        """The request's fault, or None; ``SimError`` for a header that does not parse."""
        if header is not None:
            return parse_fault(header.decode("latin-1"))
        if self.fault is not None and self.rate > 0.0 and self._rng.random() < self.rate:
            return self.fault
        return None
