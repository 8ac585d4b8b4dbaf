"""The observed stream: a tap that reads the relayed bytes into a timeline, without touching them.

The relay hands every upstream chunk to ``Tap.feed`` and sends what it returns: the same bytes, except
the one usage event the proxy asked for on the client's behalf. The tap decodes events (SSE, NDJSON
or a JSON array), lets the provider turn them into facts, and appends one content chunk per upstream
read that carried generated content. Any error inside the tap switches it off for the rest of the
stream: telemetry never breaks the user's stream.
"""

from __future__ import annotations

import logging
import zlib

from proxy.providers.base import Provider, StreamParser
from proxy.providers.usage_filter import UsageEventFilter
from proxy.sse import Decoder, decoder_for
from proxy.timeline import Timeline

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
        strip_usage: bool,
        stream_requested: bool,
    ) -> None:
        self.tl = tl
        self.provider = provider
        self.active = provider is not None
        encoding = content_encoding.strip().lower()
        # The filter reads SSE framing; on a compressed body it could find nothing, so it stays off.
        plain = encoding in ("", "identity")
        self._filter = UsageEventFilter() if strip_usage and provider is not None and plain else None
        self._decoder: Decoder | None = None
        self._parser: StreamParser | None = None
        self._body: bytearray | None = None
        self._inflate: zlib._Decompress | None = None
        if encoding in ("gzip", "deflate"):
            # Compressed bodies are relayed compressed; the tap reads a decompressed copy.
            self._inflate = zlib.decompressobj(wbits=47 if encoding == "gzip" else 15)
        elif encoding not in ("", "identity"):
            self.active = False
        if provider is None or not self.active:
            return
        framing = _framing(content_type, provider, stream_requested)
        if framing is not None:
            self._decoder = decoder_for(framing)
            self._parser = provider.stream_parser()
        else:
            self._body = bytearray()

    @property
    def changes_body(self) -> bool:
        """True when the client's bytes may differ from upstream's (a usage event is removed)."""
        return self._filter is not None

    def feed(self, chunk: bytes, t: float) -> bytes:
        """Observe one upstream chunk arriving at ``t``; return the bytes to send to the client."""
        tl = self.tl
        tl.response_bytes += len(chunk)
        if tl.first_byte is None:
            tl.first_byte = t
        if self.active:
            try:
                self._observe(chunk, t)
            except Exception:
                self.active = False
                log.exception("stream tap failed; relaying the rest of %s %s unobserved", tl.method, tl.path)
        if self._filter is not None:
            try:
                return self._filter.feed(chunk)
            except Exception:
                log.exception("usage filter failed; relaying unfiltered")
                # The chunk is already inside the filter's held bytes: flushing returns it once.
                held = self._filter.flush()
                self._filter = None
                return held
        return chunk

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

    def finish(self, t: float) -> bytes:
        """The stream ended at ``t``: parse a buffered body, flush decoders; return any held bytes."""
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
                    tl.oversized_events = self._decoder.oversized
            except Exception:
                log.exception("stream tap failed at the end of %s %s", tl.method, tl.path)
        if self._filter is not None:
            try:
                return self._filter.flush()
            except Exception:
                log.exception("usage filter failed at the end of the stream")
        return b""
