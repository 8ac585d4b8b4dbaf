"""The observed stream: a tap that reads a response's bytes, read by read, into a timeline.

The telemetry side plays each upstream read of the relay's tape into ``Tap.feed`` at the time it
arrived. The tap decodes events (SSE, NDJSON or a JSON array; compressed as ``llmtap.compression`` reads:
gzip with its members, x-gzip, deflate), lets the provider
turn them into facts, and appends one content chunk per upstream read that carried generated content.
Any error inside the tap switches it off for the rest of the stream and is logged.

Compressed bodies are inflated in steps of at most ``INFLATE_STEP`` bytes, each decoded before the next, so
no step holds or takes much. A response that inflates past ``MAX_INFLATED_BYTES``, or past
``MAX_INFLATE_RATIO`` times its compressed bytes (beyond a first ``INFLATE_ALLOWANCE``), is a bomb or as
good as one: the tap stops reading it and says why (``Timeline.unread``). The relay relayed it byte for byte
anyway; only its telemetry ends there, and the rest of the process never waits long for it.
"""

from __future__ import annotations

import logging

from llmtap.analysis.timeline import Timeline
from llmtap.compression import InflateLimit, Inflater, decodable
from llmtap.providers.base import Provider, StreamParser
from llmtap.providers.sse import Decoder, decoder_for

__all__ = ["MAX_INFLATED_BYTES", "Tap"]

log = logging.getLogger("llmtap.stream")

#: A non-streamed body larger than this is relayed but not parsed.
MAX_BODY_BYTES = 32 * 1024 * 1024
#: Inflated bytes one decompression step yields at most.
INFLATE_STEP = 256 * 1024
#: Inflated bytes the tap reads of one response at most.
MAX_INFLATED_BYTES = 64 * 1024 * 1024
#: Inflated bytes per compressed byte past the allowance: gzip'd SSE runs 13x to 37x, identical events
#: repeated without a flush about 250x; a bomb is near deflate's limit of about 1000x.
MAX_INFLATE_RATIO = 256
INFLATE_ALLOWANCE = 1024 * 1024


def _framing(content_type: str, provider: Provider, stream_requested: bool) -> str | None:
    """How the response body is framed, or None for a whole body parsed at the end."""
    ct = content_type.split(";", 1)[0].strip().lower()
    if ct == "text/event-stream":
        return "sse"
    if ct in ("application/x-ndjson", "application/jsonl"):
        return "ndjson"
    if ct == "application/json" and stream_requested and provider.framing == "json-array":
        return "json-array"
    return None


class Tap:
    """Feeds one response's bytes to the provider's parser and records the timeline."""

    def __init__(
        self,
        tl: Timeline,
        provider: Provider | None,
        *,
        content_type: str,
        content_encoding: str,
        stream_requested: bool,
    ) -> None:
        self.tl = tl
        self.provider = provider
        self.active = provider is not None
        encoding = content_encoding.strip().lower()
        self._decoder: Decoder | None = None
        self._parser: StreamParser | None = None
        self._body: bytearray | None = None
        self._inflate: Inflater | None = None
        self._framing: str | None = None
        self._content = False  # whether the read being observed carried content
        self._output = False  # ... and whether any of it was answer content, not reasoning alone
        self._oversized = 0  # counted by decoders that a gap in the bytes replaced
        if decodable(encoding):
            # Compressed bodies are relayed compressed; the tap reads a decompressed copy.
            self._inflate = Inflater(
                encoding,
                MAX_INFLATED_BYTES,
                piece=INFLATE_STEP,
                ratio=MAX_INFLATE_RATIO,
                allowance=INFLATE_ALLOWANCE,
            )
        elif encoding not in ("", "identity"):
            self.active = False
        if provider is None or not self.active:
            return
        framing = self._framing = _framing(content_type, provider, stream_requested)
        if framing is not None:
            self._decoder = decoder_for(framing)
            self._parser = provider.stream_parser()
        else:
            self._body = bytearray()

    def whole_pending(self) -> bool:
        """Whether the tap reads a body parsed whole, uncompressed, and has had none of its bytes yet: one read
        of it is then only kept until ``finish`` (``Playback.feed`` skips its loop for it)."""
        return self.active and self._inflate is None and self._body is not None and not self._body

    def feed(self, chunk: bytes, t: float) -> None:
        """Observe one upstream chunk that arrived at ``t``."""
        tl = self.tl
        tl.response_bytes += len(chunk)
        if tl.first_byte is None:
            tl.first_byte = t
        if self.active:
            try:
                self._observe(chunk, t)
            except Exception:
                self.active = False
                log.exception("stream tap failed; the rest of %s %s is not observed", tl.method, tl.path)

    def skip(self, size: int, t: float) -> None:
        """A read of ``size`` bytes at ``t`` whose bytes never arrived here: counted, and decoding starts over.

        The next bytes begin mid-event: a fresh decoder drops that partial event (counted as malformed at
        worst) and reads every later one; a whole body with a hole in it is not parsed at all.
        """
        tl = self.tl
        tl.response_bytes += size
        if tl.first_byte is None:
            tl.first_byte = t
        if self._body is not None or self._inflate is not None:
            # A hole in a whole body, or in a compressed stream, leaves nothing that can be read after it.
            self._body = None
            self.active = False
        elif self._decoder is not None and self._framing is not None:
            self._oversized += self._decoder.oversized
            self._decoder = decoder_for(self._framing)

    def _observe(self, chunk: bytes, t: float) -> None:
        if self._inflate is None:
            self._take(chunk)
        else:
            self._take_compressed(chunk)
        if self._content:
            self._content = False
            self.tl.add_chunk(t, len(chunk), "", output=self._output)
            self._output = False

    def _take_compressed(self, chunk: bytes) -> None:
        """Inflate one read step by step, each step decoded before the next; stop at the bounds."""
        assert self._inflate is not None
        try:
            for step in self._inflate.feed(chunk):
                self._take(step)
                if not self.active:
                    return
        except InflateLimit:
            self._stop("inflate_limit")

    def _flush_inflater(self) -> None:
        """Read what the decompressor still holds at the end of the body."""
        assert self._inflate is not None
        try:
            tail = self._inflate.flush()
            if tail:
                self._take(tail)
        except InflateLimit:
            self._stop("inflate_limit")
        except Exception:
            self.active = False
            log.exception("stream tap failed at the end of %s %s", self.tl.method, self.tl.path)

    def _take(self, data: bytes) -> None:
        if self._body is not None:
            if len(self._body) + len(data) > MAX_BODY_BYTES:
                self._stop("body_limit")
                return
            self._body += data
            return
        assert self._decoder is not None and self._parser is not None
        tl = self.tl
        parser = self._parser
        for event in self._decoder.feed(data):
            facts = parser.feed(event)
            if facts is None:
                continue
            tl.apply(facts)
            if facts.has_content:
                self._content = True
                self._output = self._output or not facts.reasoning
                tl.add_text(facts.content)

    def _stop(self, reason: str) -> None:
        """Stop reading the response (it is still relayed whole): ``reason`` goes on its span and counters."""
        self._body = None
        self.active = False
        self.tl.unread = reason

    def finish(self, t: float) -> None:
        """The stream ended at ``t``: parse a buffered body, flush decoders."""
        tl = self.tl
        if self.active and self._inflate is not None:
            self._flush_inflater()
        if self.active and self.provider is not None:
            try:
                if self._body is not None:
                    body = self.provider.parse_body(bytes(self._body))
                    body.done = True  # a whole body: what arrived is all there is
                    tl.apply(body)
                    if body.has_content:
                        tl.add_chunk(t, len(self._body), body.content)
                elif self._decoder is not None and self._parser is not None:
                    for event in self._decoder.flush():
                        facts = self._parser.feed(event)
                        if facts is not None:
                            tl.apply(facts)
                    tl.malformed_events = self._parser.malformed
                    tl.oversized_events = self._oversized + self._decoder.oversized
            except Exception:
                log.exception("stream tap failed at the end of %s %s", tl.method, tl.path)
