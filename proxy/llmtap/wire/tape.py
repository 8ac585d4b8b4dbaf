"""The tape: what the relay saw of one request, in the compact form it hands to the telemetry side.

The relay does only what must happen while bytes flow; everything it learns is appended here and read
once, elsewhere (``llmtap.telemetry.intake.replay``): the request's head and its body up to the inspect limit,
the times of admission and send, the response's status and headers, and each upstream read as it came,
with the moment it arrived and the moment it was handed to the client's socket. No parsing, no
OpenTelemetry, no tokenizer: appending a read costs three array appends and a ``bytearray`` extend.

A tape's memory is bounded whatever the response's length: once the reads it holds pass ``SEGMENT_BYTES``
they leave as a segment through the channel and the tape starts again empty, so an open stream holds at
most about that many bytes of response in the relay (64 KiB resident per stream). A segment the
channel cannot take, even without its bytes, becomes a hole (``punch``): its reads' bytes and the last one's
arrival, sent as a read without bytes ahead of the stream's next message (``hole_message``), or in front of its
last reads at the end; the telemetry side plays it as a gap, and the stream's record survives, partial.

What leaves is a ``Segment`` or an ``End`` message (``llmtap.wire.messages``), in its encoded form. The tape
builds that form itself, field by field in the order its named form declares (``Head``, ``Reads``, ``Tail``),
rather than building the named form and encoding it: this runs on the relay for every stream, and a
``NamedTuple`` made and then copied to a plain tuple costs about three times as much. ``tests/wire/test_wire.py``
decodes a tape's messages and compares every named field with the tape's own attribute of that name.
"""

from __future__ import annotations

import os
import random
import time
from array import array

from llmtap.wire.messages import END, SEGMENT, Raw

__all__ = [
    "END",
    "SEGMENT",
    "SEGMENT_BYTES",
    "Tape",
    "new_record_id",
    "new_span_id",
    "new_trace_id",
    "now",
    "shard_of",
]

#: Reads held before they leave as a segment (the relay's per-stream response memory).
SEGMENT_BYTES = 32 * 1024

_ids = random.Random(os.urandom(16))

#: The one monotonic clock every timestamp of llmtap comes from, in both processes.
now = time.perf_counter


def new_trace_id() -> int:
    """A random, valid (non-zero) 128-bit trace id, made without the SDK (W3C Trace Context section 3.2.2.3)."""
    while True:
        value = _ids.getrandbits(128)
        if value:
            return value


def new_span_id() -> int:
    """A random, valid (non-zero) 64-bit span id."""
    while True:
        value = _ids.getrandbits(64)
        if value:
            return value


def new_record_id() -> int:
    """A random, non-zero 128-bit id for a request's record: made with its tape, whether or not it is traced, and
    carried in the tape's head, so a record the journal replays has the id its first copy had (readers keep one)."""
    while True:
        value = _ids.getrandbits(128)
        if value:
            return value


def shard_of(trace_id: int, key: int, shards: int) -> int:
    """Which of ``shards`` telemetry processes records a request: its trace id's high half modulo their number
    (the trace's spans, wherever they arrive, can be passed to the same one), its tape key where it has no trace.

    The high half, since a ratio sampler decides on the low one: every process gets its share of sampled traces.
    """
    return ((trace_id >> 64) if trace_id else key) % shards


class Tape:
    """One request as the relay saw it; times are ``time.perf_counter()`` seconds, like the rest of llmtap."""

    __slots__ = (
        "_data",
        "_delivered",
        "_sizes",
        "_times",
        "admitted",
        "attribution",
        "body",
        "body_complete",
        "body_read",
        "cancelled",
        "end",
        "error_message",
        "error_type",
        "head_sent",
        "headers_at",
        "hole_at",
        "hole_size",
        "inner_path",
        "key",
        "key_fingerprint",
        "method",
        "parent",
        "path",
        "prompt_version",
        "protocol",
        "received",
        "received_wall_ns",
        "record_id",
        "response_bytes",
        "response_headers",
        "route",
        "sampled",
        "segments",
        "sent",
        "span_id",
        "status_code",
        "strip_usage",
        "surplus",
        "trace_id",
        "upstream_ahead",
        "upstream_seq",
        "written",
    )

    def __init__(
        self,
        key: int,
        *,
        method: str,
        path: str,
        inner_path: str,
        route: str,
        protocol: str | None,
        received: float,
        received_wall_ns: int,
    ) -> None:
        self.key = key
        self.method = method
        self.path = path
        self.inner_path = inner_path
        self.route = route
        self.protocol = protocol
        self.received = received
        self.received_wall_ns = received_wall_ns
        #: What identifies the request's record, traced or not (``new_record_id``).
        self.record_id = new_record_id()
        self.prompt_version: bytes | None = None
        #: The caller's other ``x-llmtap-*`` and its ``x-slo-*`` headers (lower-case name, value), and its API key's
        #: fingerprint.
        self.attribution: list[tuple[bytes, bytes]] = []
        self.key_fingerprint: str | None = None
        #: The client's ``traceparent`` and ``tracestate`` as sent (the telemetry side parses them).
        self.parent: tuple[str, str] | None = None
        self.trace_id = 0
        self.span_id = 0
        self.sampled = True
        #: The request body up to the inspect limit: its bytes, or (a large one) the pieces it came in.
        self.body: bytes | tuple[bytes, ...] = b""
        self.body_complete = True
        self.strip_usage = False
        self.body_read: float | None = None
        self.admitted: float | None = None
        self.sent: float | None = None
        #: When the request's head went onto the upstream connection, after any connect and TLS handshake.
        self.written: float | None = None
        self.headers_at: float | None = None
        self.status_code: int | None = None
        self.response_headers: list[tuple[bytes, bytes]] = []
        self.upstream_seq: int | None = None
        self.upstream_ahead = 0
        self.end: float | None = None
        self.error_type: str | None = None
        self.error_message: str | None = None
        self.cancelled = False
        self.surplus = 0
        self.response_bytes = 0
        self._data = bytearray()
        self._times = array("d")
        self._delivered = array("d")
        self._sizes = array("l")
        #: Segments handed over so far, and whether the head went with the first one.
        self.segments = 0
        self.head_sent = False
        #: Response bytes of segments the channel could not take (``punch``), and when the last of their reads came.
        self.hole_size = 0
        self.hole_at = 0.0

    # -- the hot path -------------------------------------------------------------------------

    def read(self, t: float, data: bytes) -> bool:
        """One upstream read arrived at ``t``; True when the tape is full and a segment should leave."""
        self._times.append(t)
        self._sizes.append(len(data))
        self._data += data
        self.response_bytes += len(data)
        return len(self._data) >= SEGMENT_BYTES

    def delivered(self, t: float) -> None:
        """The last read was handed to the client's socket at ``t``."""
        self._delivered.append(t)

    def fail(self, error_type: str, message: str | None = None, *, cancelled: bool = False) -> None:
        """What went wrong in the relay (first failure wins; a client leaving always counts as cancelled)."""
        if cancelled:
            self.cancelled = True
        if self.error_type is None:
            self.error_type = error_type
            self.error_message = message

    # -- the wire form ------------------------------------------------------------------------

    def head(self) -> Raw:
        """Everything known once the response's headers are in: the request and the response's start (a ``Head``,
        encoded)."""
        return (
            self.method,
            self.path,
            self.inner_path,
            self.route,
            self.protocol,
            self.received,
            self.received_wall_ns,
            self.prompt_version,
            self.parent,
            self.trace_id.to_bytes(16, "big"),
            self.span_id.to_bytes(8, "big"),
            self.sampled,
            self.body,
            self.body_complete,
            self.strip_usage,
            self.body_read,
            self.admitted,
            self.sent,
            self.written,
            self.headers_at,
            self.status_code,
            tuple(self.response_headers),
            self.upstream_seq,
            self.upstream_ahead,
            tuple(self.attribution),
            self.key_fingerprint,
            self.record_id.to_bytes(16, "big"),
        )

    def take_reads(self, *, last: bool = False) -> tuple[bytes, bytes, bytes, bytes]:
        """The reads held now (``Reads``, encoded), leaving the tape empty; ``last``: the stream's end takes them, and
        nothing is read onto the tape after it (no empty arrays are made for reads that never come)."""
        # A read not yet handed to the client (the relay failed sending it) has no delivery time.
        while len(self._delivered) < len(self._times):
            self._delivered.append(float("nan"))
        out = (self._times.tobytes(), self._delivered.tobytes(), self._sizes.tobytes(), bytes(self._data))
        if last:
            return out
        self._times = array("d")
        self._delivered = array("d")
        self._sizes = array("l")
        self._data = bytearray()
        return out

    def tail(self) -> Raw:
        """What the end adds: when, how, and what the relay itself counted (a ``Tail``, encoded)."""
        return (self.end, self.error_type, self.error_message, self.cancelled, self.surplus, self.response_bytes)

    def segment_message(self) -> Raw:
        """A segment of reads, with the head when it is the stream's first message (a ``Segment``, encoded)."""
        head = None if self.head_sent else self.head()
        self.head_sent = True
        self.segments += 1
        return (SEGMENT, self.key, head, self.take_reads())

    def end_message(self, relay: int = 0, seq: int = 0) -> Raw:
        """The last message of a stream: the head unless a segment carried it, the last reads, the tail (an ``End``,
        encoded), as relay ``relay``'s ``seq``-th end to its telemetry process. A hole still here leads the last reads,
        which then go without their bytes."""
        head = None if self.head_sent else self.head()
        self.head_sent = True
        reads = self.take_reads(last=True)
        if self.hole_size:
            hole = self._hole_reads()
            reads = (hole[0] + reads[0], hole[1] + reads[1], hole[2] + reads[2], b"")
        return (END, self.key, head, reads, self.tail(), relay, seq)

    # -- what the channel could not take ------------------------------------------------------

    def punch(self, message: Raw) -> None:
        """The channel could not take this segment of the tape: its reads join the hole, and the head it carried
        goes with the next message instead."""
        self.segments -= 1
        if message[2] is not None:
            self.head_sent = False
        times, sizes = array("d"), array("l")
        times.frombytes(message[3][0])
        sizes.frombytes(message[3][2])
        self.hole_size += sum(sizes)
        if times:
            self.hole_at = times[-1]

    def hole_message(self) -> Raw:
        """The hole as a segment of one read without its bytes (with the head, if none went yet); the tape changes
        only once it was sent (``hole_sent``)."""
        return (SEGMENT, self.key, None if self.head_sent else self.head(), (*self._hole_reads(), b""))

    def hole_sent(self) -> None:
        """The hole went (``hole_message``): the tape goes on without it."""
        self.head_sent = True
        self.segments += 1
        self.hole_size = 0

    def _hole_reads(self) -> tuple[bytes, bytes, bytes]:
        return (
            array("d", (self.hole_at,)).tobytes(),
            array("d", (float("nan"),)).tobytes(),
            array("l", (self.hole_size,)).tobytes(),
        )
