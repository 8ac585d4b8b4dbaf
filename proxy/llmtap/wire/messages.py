"""The messages from the relay to the telemetry side: their kinds, their named fields, an encode/decode pair each.

A stream travels as zero or more ``Segment`` messages and one ``End``; the first of them carries the ``Head``
(what is known once the response's headers are in), each carries the ``Reads`` the tape held, the end adds the
``Tail``. Every relay also reports its gauges and counts in a ``Stats`` message, and where several telemetry
processes share the requests, each tells the others what must stay whole per upstream in ``Facts``. Encoded,
a message is a plain tuple of ``bytes``, ``str``, numbers, ``None`` and tuples, its kind first: ``marshal``
carries that between processes at C speed (``llmtap.wire.framing``) and the in-process channel passes it as it
is. Decoding gives the named form back, and checks each part's field count: a relay and a telemetry process of
different builds fail loudly (``WireError``) instead of reading one field as another. The relay never decodes;
the telemetry side decodes on its worker thread, once per message.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeAlias

__all__ = [
    "BESIDE",
    "BODY_AT",
    "CLIENT_TIMEOUT_KINDS",
    "CONNECTION_REFUSAL_REASONS",
    "END",
    "FACTS",
    "RESPONSE_CUT_REASONS",
    "SEGMENT",
    "STATS",
    "End",
    "Facts",
    "Head",
    "Message",
    "Raw",
    "Reads",
    "Segment",
    "Stats",
    "Tail",
    "WireError",
    "body_beside",
    "data_size",
    "decode",
    "decode_end",
    "decode_facts",
    "decode_segment",
    "decode_stats",
    "encode",
    "encode_end",
    "encode_facts",
    "encode_segment",
    "encode_stats",
    "lift_body",
    "place_body",
    "ready_of",
    "without_bytes",
]

# Message kinds: the first field of every encoded message.
SEGMENT, END, STATS, FACTS = 1, 2, 3, 4

#: What a ``Stats`` message counts beside the gauges, as absolute numbers: client connections cut by a timeout,
#: by kind, and refused, by reason (``llmtap.listener``).
CLIENT_TIMEOUT_KINDS = ("header", "body", "idle", "send", "upload")
CONNECTION_REFUSAL_REASONS = ("limit", "per_client")
#: Why the relay itself cut a response short: ``inflate_limit``, a response it decompressed past
#: ``max_inflate_bytes`` (``llmtap.compression``).
RESPONSE_CUT_REASONS = ("inflate_limit",)

#: Encoded form: a tuple, its kind first.
Raw: TypeAlias = tuple[Any, ...]
#: Counts by label, as the relay keeps them: ``((label, count), ...)``.
Counts: TypeAlias = tuple[tuple[str, int], ...]


class WireError(ValueError):
    """A message or frame that cannot be read: garbled, cut short, or from a build with another format."""


class Head(NamedTuple):
    """The request and the response's start, as the relay saw them (times: ``llmtap.wire.tape.now`` seconds)."""

    method: str
    path: str
    #: The path the upstream is asked for (the route's prefix taken off).
    inner_path: str
    route: str
    #: The provider the relay matched (its name), None for a path no provider knows.
    protocol: str | None
    received: float
    received_wall_ns: int
    prompt_version: bytes | None
    #: The client's ``traceparent`` and ``tracestate`` as sent.
    parent: tuple[str, str] | None
    #: The ids the relay made (16 and 8 bytes, big-endian).
    trace_id: bytes
    span_id: bytes
    sampled: bool
    #: The request body up to the inspect limit, and whether that is all of it.
    body: bytes
    body_complete: bool
    #: The relay added ``include_usage`` and strips the usage event it brings.
    strip_usage: bool
    body_read: float | None
    admitted: float | None
    sent: float | None
    #: The request's head went onto the upstream connection (``sent`` is before any connect): the order the
    #: upstream sees requests in.
    written: float | None
    headers_at: float | None
    status_code: int | None
    response_headers: tuple[tuple[bytes, bytes], ...]
    upstream_seq: int | None
    upstream_ahead: int
    #: The caller's other ``x-llmtap-*`` headers and its ``x-slo-*`` objectives (lower-case name, value), and its
    #: API key's fingerprint.
    attribution: tuple[tuple[bytes, bytes], ...]
    key_fingerprint: str | None
    #: What identifies the request's record, traced or not (16 bytes, big-endian; ``llmtap.wire.tape.new_record_id``).
    record_id: bytes


class Reads(NamedTuple):
    """A run of upstream reads: arrival times, delivery times (NaN: never delivered) as ``array('d')`` bytes,
    sizes as ``array('l')`` bytes, and the bytes read (empty when they were dropped: timing only)."""

    times: bytes
    delivered: bytes
    sizes: bytes
    data: bytes


class Tail(NamedTuple):
    """What a stream's end adds: when, how, and what the relay itself counted."""

    end: float | None
    error_type: str | None
    error_message: str | None
    cancelled: bool
    #: Bytes past the end of the response (the connection was closed).
    surplus: int
    response_bytes: int


class Segment(NamedTuple):
    """Reads of an open stream, sent when the tape filled; the head when it is the stream's first message."""

    key: int
    head: Head | None
    reads: Reads


class End(NamedTuple):
    """A stream's last message: the head unless a segment carried it, the last reads, the tail; and which relay
    handed it over (a random id, ``llmtap.wire.ledger.new_relay_id``) as its ``seq``-th end to this telemetry
    process: the record journal counts the ends that never reached it by the gaps
    (``llmtap.telemetry.journal.spool``)."""

    key: int
    head: Head | None
    reads: Reads
    tail: Tail
    relay: int = 0
    seq: int = 0


class Stats(NamedTuple):
    """A relay's readiness, gauges and counts, all absolute (the telemetry side adds the change)."""

    ready: bool
    #: Tapes the relay dropped so far (its channel was full).
    dropped: int
    #: Streams in flight, and requests waiting for admission, by route.
    active: Counts
    waiting: Counts
    #: ``CLIENT_TIMEOUT_KINDS``, ``CONNECTION_REFUSAL_REASONS``, ``RESPONSE_CUT_REASONS``.
    timeouts: Counts
    refused: Counts
    cuts: Counts
    #: Which relay (its random id, ``llmtap.wire.ledger.new_relay_id``): its totals are kept by id across telemetry
    #: restarts (``llmtap.telemetry.journal.losses``); 0: not said.
    relay: int = 0


class Facts(NamedTuple):
    """What requests one telemetry process recorded taught it that the others must learn too (the state kept whole
    per upstream, ``llmtap.telemetry.fleet.siblings``): each lesson a plain tuple, its kind first."""

    lessons: tuple[tuple[Any, ...], ...]


Message: TypeAlias = Segment | End | Stats | Facts

_HEAD, _READS, _TAIL = len(Head._fields), len(Reads._fields), len(Tail._fields)
_SEGMENT, _END, _STATS = 1 + len(Segment._fields), 1 + len(End._fields), 1 + len(Stats._fields)
_NAMES = {SEGMENT: "segment", END: "end", STATS: "stats", FACTS: "facts"}


# -- encoding (the relay) -------------------------------------------------------------------------


def encode_segment(m: Segment) -> Raw:
    """A segment as it crosses."""
    return (SEGMENT, m.key, None if m.head is None else tuple(m.head), tuple(m.reads))


def encode_end(m: End) -> Raw:
    """An end as it crosses."""
    return (END, m.key, None if m.head is None else tuple(m.head), tuple(m.reads), tuple(m.tail), m.relay, m.seq)


def encode_stats(m: Stats) -> Raw:
    """A relay's report as it crosses."""
    return (STATS, *m)


def encode_facts(m: Facts) -> Raw:
    """A telemetry process's lessons as they cross."""
    return (FACTS, tuple(m.lessons))


def encode(m: Message) -> Raw:
    """Any message as it crosses."""
    if isinstance(m, Segment):
        return encode_segment(m)
    if isinstance(m, End):
        return encode_end(m)
    if isinstance(m, Facts):
        return encode_facts(m)
    return encode_stats(m)


def without_bytes(raw: Raw) -> Raw | None:
    """An encoded segment or end with its reads' bytes left out (their times and sizes kept: the stream's timing
    survives, its record counts as partial); None when there is nothing to leave out."""
    kind = raw[0]
    if kind != SEGMENT and kind != END:
        return None
    times, delivered, sizes, data = raw[3]
    if not data:
        return None
    return (*raw[:3], (times, delivered, sizes, b""), *raw[4:])


#: Where the request body sits in an encoded ``Head``; ``BESIDE`` there says it travels beside its message, in a
#: frame of its own (``llmtap.wire.framing``): a body of megabytes is then never copied into the message's frame.
BODY_AT = Head._fields.index("body")
BESIDE = ...


def lift_body(raw: Raw, least: int) -> tuple[Raw, bytes | tuple[bytes, ...] | None]:
    """An encoded segment or end whose head carries a body past ``least`` bytes, or in pieces (the relay keeps a
    large body as the pieces it came in): the message with ``BESIDE`` in the body's place, and the body; any other
    message as it is, and None."""
    kind = raw[0]
    head = raw[2] if kind == SEGMENT or kind == END else None
    if head is None:
        return raw, None
    body = head[BODY_AT]
    if type(body) is not tuple and len(body) <= least:
        return raw, None
    return (*raw[:2], (*head[:BODY_AT], BESIDE, *head[BODY_AT + 1 :]), *raw[3:]), body


def body_beside(raw: Raw) -> bool:
    """Whether an encoded message's body travels beside it (``lift_body``)."""
    kind = raw[0]
    head = raw[2] if (kind == SEGMENT or kind == END) and len(raw) > 2 else None
    return type(head) is tuple and len(head) > BODY_AT and head[BODY_AT] is BESIDE


def place_body(raw: Raw, body: bytes) -> Raw:
    """The message ``lift_body`` took ``body`` from, whole again."""
    head = raw[2]
    return (*raw[:2], (*head[:BODY_AT], body, *head[BODY_AT + 1 :]), *raw[3:])


def data_size(raw: Raw) -> int:
    """The response bytes an encoded message carries (0 for a report)."""
    kind = raw[0]
    return len(raw[3][3]) if kind == SEGMENT or kind == END else 0


def ready_of(raw: Raw) -> bool | None:
    """An encoded report's readiness, read without decoding the rest; None for any other message."""
    return bool(raw[1]) if raw[0] == STATS and len(raw) > 1 else None


# -- decoding (the telemetry side) ----------------------------------------------------------------

# ``tuple.__new__`` with the class: a named tuple made from a plain one with no Python-level ``__new__`` (decoding
# runs once per message on the telemetry side; this keeps it near the positional unpacking it replaced).
_new = tuple.__new__


def _mismatch(raw: Any, expected: int, what: str) -> WireError:
    if type(raw) is not tuple:
        return WireError(f"a {what} that is not a tuple ({type(raw).__name__})")
    return WireError(
        f"a {what} of {len(raw)} fields where this build has {expected}: "
        "the relay and the telemetry process are from different builds of llmtap"
    )


def _head(raw: Any) -> Head | None:
    if raw is None:
        return None
    if type(raw) is not tuple or len(raw) != _HEAD:
        raise _mismatch(raw, _HEAD, "message head")
    if type(raw[BODY_AT]) is tuple:  # a body in pieces, handed over in this process: joined here, off the relay
        raw = (*raw[:BODY_AT], b"".join(raw[BODY_AT]), *raw[BODY_AT + 1 :])
    return _new(Head, raw)


def _reads(raw: Any) -> Reads:
    if type(raw) is not tuple or len(raw) != _READS:
        raise _mismatch(raw, _READS, "run of reads")
    return _new(Reads, raw)


def decode_segment(raw: Raw) -> Segment:
    """A segment from its encoded form."""
    if type(raw) is not tuple or len(raw) != _SEGMENT:
        raise _mismatch(raw, _SEGMENT, "segment message")
    return _new(Segment, (raw[1], _head(raw[2]), _reads(raw[3])))


def decode_end(raw: Raw) -> End:
    """An end from its encoded form."""
    if type(raw) is not tuple or len(raw) != _END:
        raise _mismatch(raw, _END, "end message")
    tail = raw[4]
    if type(tail) is not tuple or len(tail) != _TAIL:
        raise _mismatch(tail, _TAIL, "message tail")
    return _new(End, (raw[1], _head(raw[2]), _reads(raw[3]), _new(Tail, tail), raw[5], raw[6]))


def decode_stats(raw: Raw) -> Stats:
    """A relay's report from its encoded form."""
    if type(raw) is not tuple or len(raw) != _STATS:
        raise _mismatch(raw, _STATS, "stats message")
    return _new(Stats, raw[1:])


def decode_facts(raw: Raw) -> Facts:
    """A telemetry process's lessons from their encoded form (each one is checked where it is learned)."""
    if type(raw) is not tuple or len(raw) != 2:
        raise _mismatch(raw, 2, "facts message")
    lessons = raw[1]
    if type(lessons) is not tuple or not all(type(x) is tuple and x for x in lessons):
        raise WireError("a facts message whose lessons are not non-empty tuples")
    return Facts(lessons)


def decode(raw: Raw) -> Message:
    """Any message from its encoded form; ``WireError`` names what is wrong with one that cannot be read."""
    if type(raw) is not tuple or not raw:
        raise WireError(f"a message that is not a non-empty tuple: {type(raw).__name__}")
    kind = raw[0]
    if kind == END:
        return decode_end(raw)
    if kind == SEGMENT:
        return decode_segment(raw)
    if kind == STATS:
        return decode_stats(raw)
    if kind == FACTS:
        return decode_facts(raw)
    raise WireError(f"a message of unknown kind {kind!r} (this build knows {sorted(_NAMES)})")
