"""The tape's hand-over to the telemetry side: segments as a long stream's tape fills, the end once, in ``finally``.

The channel never makes a stream wait: what it cannot take is sent again without the response bytes (the reads'
times and sizes, a few bytes each), else becomes a hole in the stream (``Tape.punch``) sent ahead of what follows
it once there is room, else the tape is counted dropped.
"""

from __future__ import annotations

import logging

from llmtap.relay.channel import Channel
from llmtap.relay.gauges import Gauges
from llmtap.wire.ledger import Ledger
from llmtap.wire.messages import Raw, without_bytes
from llmtap.wire.tape import Tape, shard_of

__all__ = ["Handover"]

log = logging.getLogger("llmtap.proxy")


class Handover:
    """Sends each request's tape through ``channel``, to the telemetry process its trace id picks (``shard_of``)."""

    def __init__(self, channel: Channel, gauges: Gauges, relay_id: int) -> None:
        self.channel = channel
        self._gauges = gauges
        self._shards = channel.shards
        #: This relay, to the telemetry side's record journal: its id, and per telemetry process the number of the
        #: last stream end handed to the channel (``End.seq``: a gap there is an end lost on its way).
        self.relay_id = relay_id
        self._handed = [0] * self._shards
        #: The ledger of those numbers in the journal's folder, for the next start after a kill of the whole tree
        #: (``llmtap.wire.ledger``; ``llmtap.serve.relay`` opens it); None: none kept.
        self.ledger: Ledger | None = None

    def segment(self, tape: Tape) -> None:
        """The tape is full mid-stream: its reads leave now, so a long stream holds little here. What the channel
        cannot take, even without its bytes, becomes a hole in the stream (``Tape.punch``), sent ahead of what
        follows it once there is room: the stream keeps its record, partial."""
        shard = shard_of(tape.trace_id, tape.key, self._shards)
        if tape.hole_size:
            if not self.channel.send(tape.hole_message(), reserve=True, shard=shard):
                tape.punch(tape.segment_message())
                return
            tape.hole_sent()
        message = tape.segment_message()
        if not self._send(message, shard=shard):
            tape.punch(message)

    def hand_over(self, tape: Tape) -> None:
        """The request is over: its tape goes to the telemetry side, or is counted as dropped.

        The end may use the channel's reserve: it holds a stream's last reads, where usage is reported.
        """
        shard = shard_of(tape.trace_id, tape.key, self._shards)
        if tape.hole_size and self.channel.send(tape.hole_message(), reserve=True, shard=shard):
            tape.hole_sent()
        seq = self._handed[shard] + 1
        if not self._send(tape.end_message(self.relay_id, seq), reserve=True, shard=shard):
            self._gauges.tapes_dropped += 1
            log.debug("telemetry behind: dropped the tape of %s %s", tape.method, tape.path)
        else:
            self._handed[shard] = seq
            if self.ledger is not None:
                self.ledger.handed(shard, seq)
        self._gauges.ended()

    def _send(self, message: Raw, *, reserve: bool = False, shard: int = 0) -> bool:
        """Send a tape message; when the channel is full, send it again without the response bytes.

        The reads' times and sizes are a few bytes each: the telemetry side keeps the stream's timing
        exact and its record, and decodes only what it got (the stream counts as partial).
        """
        if self.channel.send(message, reserve=reserve, shard=shard):
            return True
        timing = without_bytes(message)
        return timing is not None and self.channel.send(timing, reserve=True, shard=shard)
