"""The base of llmtap's own errors, at the bottom of the layers so that every package can raise and catch them.

``except LlmtapError`` catches what llmtap itself decided to raise (a bound passed, a client gone, a line full, an
upstream that failed: ``llmtap.relay.upstream.errors``), and never a library's error or a bug.
"""

from __future__ import annotations

__all__ = ["ClientGone", "LlmtapError"]


class LlmtapError(Exception):
    """An error llmtap raises on purpose: every class of llmtap's own errors derives from it."""


class ClientGone(LlmtapError):
    """The client's connection closed before its answer was whole: what was in flight for it stops."""
