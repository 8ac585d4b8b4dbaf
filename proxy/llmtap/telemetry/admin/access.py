"""Who may use what the admin listener offers that takes data in or costs: the span receiver and the event stream.

Loopback peers may (unless ``admin_loopback_token`` asks them too: in a pod, every container shares the
loopback); a peer beyond loopback must send ``Authorization: Bearer TOKEN`` with the configured token
(``admin_token_file`` or ``LLMTAP_ADMIN_TOKEN``), compared in constant time. With no token configured such a
peer is refused outright: the receiver forwards what it takes to the traces backend with the operator's own
exporter headers, so an open receiver would be an open relay carrying the operator's credentials.
``/metrics``, ``/healthz``, ``/readyz`` and the live view's page stay open: they take nothing in, and the
probes and scrapers that read them carry no token.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from starlette.requests import Request

from llmtap.config.types import Admin

__all__ = ["Gate", "is_loopback"]


@dataclass(frozen=True, slots=True)
class AdminRefusal:
    """Why a request is refused: its HTTP status, a reason (a metric label) and a message for the sender."""

    status: int
    reason: str
    message: str


def is_loopback(host: str | None) -> bool:
    """Whether a peer address is on loopback (IPv4, IPv6, or IPv4 mapped into IPv6)."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


class Gate:
    """Decides, from a request's peer and ``Authorization`` header, whether it may use a guarded endpoint."""

    def __init__(self, admin: Admin) -> None:
        self._token = admin.token.encode() if admin.token else None
        self._loopback_free = not admin.loopback_token

    def refusal(self, request: Request, what: str) -> AdminRefusal | None:
        """None when ``request`` may go on; else why not (``what`` names the endpoint in the message)."""
        client = request.client
        # No peer address: a Unix socket (another telemetry process's private admin socket, owner-only).
        if self._loopback_free and (client is None or is_loopback(client.host)):
            return None
        if self._token is None:
            return AdminRefusal(
                403,
                "forbidden",
                f"{what} takes requests from loopback only: configure admin_token_file (or LLMTAP_ADMIN_TOKEN) "
                "and send Authorization: Bearer <token>",
            )
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken says nothing of how much of the token matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            return AdminRefusal(401, "unauthorized", f"{what} needs Authorization: Bearer <the admin token>")
        return None
