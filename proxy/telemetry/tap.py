"""The observed stream: a tap that reads a response's bytes, read by read, into a timeline.

The telemetry side plays each upstream read of the relay's tape into ``Tap.feed`` at the time it
arrived. The tap decodes events (SSE, NDJSON or a JSON array, gzip and deflate too), lets the provider
turn them into facts, and appends one content chunk per upstream read that carried generated content.
Any error inside the tap switches it off for the rest of the stream and is logged.
"""

from __future__ import annotations

import logging
import zlib

from proxy.analysis.timeline import Timeline
from proxy.providers.base import Provider, StreamParser
from proxy.sse import Decoder, decoder_for

log = logging.getLogger("llmtap.stream")

#: A non-streamed body larger than this is relayed but not parsed.
MAX_BODY_BYTES = 32 * 1024 * 1024


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
        self._inflate: zlib._Decompress | None = None
        self._framing: str | None = None
        self._oversized = 0  # counted by decoders that a gap in the bytes replaced
        if encoding in ("gzip", "deflate"):
            # Compressed bodies are relayed compressed; the tap reads a decompressed copy.
            self._inflate = zlib.decompressobj(wbits=47 if encoding == "gzip" else 15)
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
        data = self._inflate.decompress(chunk) if self._inflate is not None else chunk
        if self._body is not None:
            if len(self._body) + len(data) > MAX_BODY_BYTES:
                self._body = None
                self.active = False
                return
            self._body += data
            return
        assert self._decoder is not None and self._parser is not None
        events = self._decoder.feed(data)
        if not events:
            return
        texts: list[str] = []
        content = False
        parser = self._parser
        for event in events:
            facts = parser.feed(event)
            if facts is None:
                continue
            self.tl.apply(facts)
            if facts.has_content:
                content = True
                texts.append(facts.content)
        if content:
            self.tl.add_chunk(t, len(chunk), "".join(texts))

    def finish(self, t: float) -> None:
        """The stream ended at ``t``: parse a buffered body, flush decoders."""
        tl = self.tl
        if self.active and self.provider is not None:
            try:
                if self._body is not None:
                    body = self.provider.parse_body(bytes(self._body))
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
