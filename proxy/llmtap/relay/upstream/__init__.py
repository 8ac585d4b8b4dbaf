"""A lean HTTP/1.1 client for HTTP and HTTPS upstreams: asyncio protocols, httptools parsing; what the relay calls.

httpcore's pool, anyio and h11 cost about a third of the relay's CPU per chunk (bench/archive/RESULTS-2026-12.md, "Where
the time goes"); here one protocol object per connection parses the response as it arrives and queues its
body parts. The relay calls it directly (``LeanTransport.send``: an ``Answer``, no httpx ``Request`` or
``Response``, which cost the relay about 150 µs of CPU a request); as an httpx transport it
serves httpx's client the same way (tests, tools). Split as httpcore splits the job:

* ``errors``: the client's errors, one family under ``UpstreamError``;
* ``http11``: HTTP/1.1 on the wire: the request's head, the response parsed (httptools' callbacks);
* ``connection``: one connection, its socket, reads, writes, waits and backpressure;
* ``pool``: the connections to one host and port;
* ``body``: the response's body and the ``Answer`` the relay reads;
* ``transport``: ``LeanTransport``: the pools, the connect (plain or TLS) and one exchange.

What the relay relies on, and this package keeps:

* the errors it maps, llmtap's own (``errors``: ``UpstreamError`` and its kinds): ``ConnectFailed``,
  ``ConnectTimeout``, ``PoolTimeout``, ``ReadTimeout``, ``WriteTimeout``, ``UpstreamReset``, ``UpstreamClosed``
  (closed early), ``UpstreamProtocolError`` and ``BadHead`` (malformed);
* timeouts read from the request's timeout mapping at every wait, so its switch to the idle timeout after the
  headers applies;
* body parts as they arrive, never merged or held back: one per socket read, and within a read one per
  HTTP chunk of a chunked body (as httpcore yields them: the relay's tap counts each as an upstream chunk);
* backpressure: past ``QUEUE_BYTES`` unread, the socket stops being read, and ``SO_RCVBUF`` bounds the rest;
* RFC 9112 section 6.3: bytes past the end of a response never reach the parser, are counted
  (returned by ``Answer.close``, ``response.extensions[SURPLUS]`` through httpx) and close the connection.

A relay may instead take the body in the read callback (``Body.pipe``): each part goes to its sink the moment the
parser has it, stamped once per socket read, and the relay's task wakes only when the response ends, fails or is
held. No queue, no task switch per chunk.

HTTPS is the event loop's own TLS transport (``create_connection(ssl=...)``, asyncio's or uvloop's) under
the same protocol, with the context of ``llmtap.relay.tls``: certificate and handshake failures are
``ConnectFailed`` errors that say what failed (``certificate verify failed: self-signed certificate``). asyncio
cannot hand a TLS session to ``create_connection`` for resumption; keeping connections alive in the pool
is the session reuse: one handshake per connection, and a connection serves request after request.
"""

from llmtap.relay.upstream.body import Answer
from llmtap.relay.upstream.http11 import MAX_HEAD_BYTES, Pieces
from llmtap.relay.upstream.transport import PIPE, SURPLUS, LeanTransport, Origin

__all__ = ["MAX_HEAD_BYTES", "PIPE", "SURPLUS", "Answer", "LeanTransport", "Origin", "Pieces"]
