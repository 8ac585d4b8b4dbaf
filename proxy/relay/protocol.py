"""The HTTP/1.1 server protocol llmtap runs under uvicorn: httptools, with a bound on a request's head.

httptools (llhttp) has no limit of its own on a request line or header block: uvicorn would buffer a
gigabyte of header bytes from one client. This protocol counts what arrives while a head is incomplete
and answers 431 (RFC 6585 section 5) once it passes ``h11_max_incomplete_event_size``, the limit uvicorn's
h11 protocol applies to the same thing, which ``proxy.relay.server`` sets to ``max_header_bytes``. Only bytes
of a request head are counted: request bodies and responses pay nothing.

It also stamps each request with the moment its first byte was read from the socket (``RECEIVED`` in
the scope's extensions): TTFT as the client sees it starts there, not when the application is called,
so time the proxy spends before its handler runs (a busy event loop) shows in its own numbers.
"""

from __future__ import annotations

import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_MAX_HEAD = 64 * 1024
#: The scope extension holding the ``time.perf_counter()`` of the read that brought a request's first byte.
RECEIVED = "llmtap.received"

_TOO_LARGE = b"request line and headers too large\n"
_RESPONSE_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: " + str(len(_TOO_LARGE)).encode() + b"\r\n"
    b"connection: close\r\n\r\n" + _TOO_LARGE
)


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that refuses a request head longer than the configured limit."""

    _head_bytes = -1  # bytes received while the current request head is incomplete; -1 outside a head
    _read_at = 0.0  # when the data being parsed was read

    def on_message_begin(self) -> None:
        """A request starts: its head is being received, and its first byte came with the current read."""
        super().on_message_begin()
        self.scope["extensions"] = {RECEIVED: self._read_at}  # type: ignore[dict-item]
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        """The head is complete: stop counting."""
        self._head_bytes = -1
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        """Parse, then refuse the connection's request if its head is still incomplete and too large."""
        self._read_at = time.perf_counter()
        super().data_received(data)
        if self._head_bytes < 0 or self.transport.is_closing():
            return
        self._head_bytes += len(data)
        if self._head_bytes > (self.config.h11_max_incomplete_event_size or DEFAULT_MAX_HEAD):
            self._head_bytes = -1
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(_RESPONSE_431)
            # Mid-response (a pipelined head), the response in flight is cut rather than interleaved.
            self.transport.close()

    def _unsupported_upgrade_warning(self) -> None:
        """The parser stopped at an Upgrade request (uvicorn serves no WebSocket here, ``ws="none"``).

        The relay answers the request itself (a refusal, or HTTP/1.1 for an ignorable ``h2c`` offer), and
        the parser reads nothing more on this connection, so the answer closes it. No warning: this is the
        relay's designed answer, not a fault of the server.
        """
        if self.cycle is not None:
            self.cycle.keep_alive = False
