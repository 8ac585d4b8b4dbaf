"""The upstream client's errors: one family under ``UpstreamError``, a class per way an exchange fails.

The relay answers each kind its own way (``llmtap.relay.answers``): a timeout 504, a connection never made
``502 upstream_unreachable``, a connection that broke ``502 upstream_closed``, a head that cannot be read
``502 upstream_protocol_error``. Each class's ``label`` is the name those answers, their log lines and the
request's span status give the failure (``ReadTimeout: upstream sent nothing for 5 s``): the names llmtap has
always shown, so an operator's alert on them keeps matching.
"""

from __future__ import annotations

from llmtap.errors import LlmtapError

__all__ = [
    "BadHead",
    "BadRequestHead",
    "ConnectFailed",
    "ConnectTimeout",
    "PoolTimeout",
    "ReadTimeout",
    "UnsupportedScheme",
    "UpstreamClosed",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamReset",
    "UpstreamTimeout",
    "WriteTimeout",
]


class UpstreamError(LlmtapError):
    """An exchange with an upstream failed; what the relay catches of its upstream client."""

    #: What the relay's answers and log lines call this failure.
    label = "UpstreamError"


class ConnectFailed(UpstreamError):
    """No connection was made: refused, no address, or the TLS handshake failed (the message says which)."""

    label = "ConnectError"


class UpstreamTimeout(UpstreamError):
    """A wait passed its timeout: the relay answers 504."""

    label = "TimeoutException"


class ConnectTimeout(UpstreamTimeout):
    """No connection within the connect timeout."""

    label = "ConnectTimeout"


class PoolTimeout(UpstreamTimeout):
    """Every connection to the upstream stayed busy past the pool timeout."""

    label = "PoolTimeout"


class ReadTimeout(UpstreamTimeout):
    """The upstream sent nothing for the read timeout (before the head) or the idle timeout (after it)."""

    label = "ReadTimeout"


class WriteTimeout(UpstreamTimeout):
    """The upstream took none of the request body for the write timeout."""

    label = "WriteTimeout"


class UpstreamReset(UpstreamError):
    """The upstream reset the connection mid-exchange."""

    label = "ReadError"


class UpstreamClosed(UpstreamError):
    """The upstream closed the connection before its response was whole (or before the request was sent)."""

    label = "RemoteProtocolError"


class UpstreamProtocolError(UpstreamError):
    """The upstream's bytes are not HTTP/1.1: a malformed chunked body, or a head (``BadHead``)."""

    label = "RemoteProtocolError"


class BadHead(UpstreamProtocolError):
    """The upstream's response head cannot be read (malformed, too long, a protocol switch nobody asked for)."""


class BadRequestHead(UpstreamError):
    """The request's head would carry a CR or LF inside a header: not sent."""

    label = "LocalProtocolError"


class UnsupportedScheme(UpstreamError):
    """The upstream's URL is not ``http`` or ``https``."""

    label = "UnsupportedProtocol"
