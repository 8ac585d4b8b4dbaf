"""The TLS side of HTTPS upstreams: one ``ssl.SSLContext`` per route's TLS settings, built at start.

Defaults are what Python users expect of ``ssl.create_default_context()``: OpenSSL's default paths, which
``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` override; certifi's bundle only when those paths hold nothing. A
route's ``tls_ca`` / ``tls_ca_dir`` replace them; ``tls_cert`` (+ ``tls_key``) is the client certificate of
mutual TLS. TLS 1.2 at least, ALPN ``http/1.1``. The settings hold only the route's TLS settings; the
contexts are built here when the upstreams' clients are made (``llmtap.relay.forward.Upstreams``), once per
route at start and cached, and ``check`` builds them before the processes start. A file that is missing or
does not load is a ``ConfigError`` naming the setting as the user gave it and the file, never at a request.

A context resumes TLS sessions (``ResumingContext``): a new connection to a server name offers the session the last
connection to that name left (a TLS 1.3 ticket, or a TLS 1.2 ticket or session id), so its handshake skips the
certificate chain and the server's signature; a server that declines it makes a full handshake, as without. The
lean client hands each connection's session back once its first exchange ends (``keep``). Keyed by server name,
as Go's client session cache is, and on by default as nginx's ``proxy_ssl_session_reuse``.

Connection errors get names here too (``describe``): a certificate the upstream's chain does not prove
becomes ``certificate verify failed: <OpenSSL's reason>``, anything else in the handshake
``TLS handshake failed: <reason>``.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llmtap.config.types import ConfigError, Route

__all__ = ["ResumingContext", "TLSOptions", "check", "context", "describe", "route_context"]

#: Server names whose last session a context keeps; past it, the oldest is forgotten.
SESSIONS = 256


@dataclass(frozen=True, slots=True)
class TLSOptions:
    """A route's TLS settings, the key of its context (routes with equal ones share one)."""

    ca: str | None = None
    ca_dir: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None
    verify: bool = True

    @classmethod
    def of(cls, route: Route) -> TLSOptions:
        return cls(
            ca=route.tls_ca,
            ca_dir=route.tls_ca_dir,
            cert=route.tls_cert,
            key=route.tls_key,
            server_name=route.tls_server_name,
            verify=route.tls_verify,
        )


class ResumingContext(ssl.SSLContext):
    """A client context whose connections offer the last session of their server name (see the module's words)."""

    def __init__(self, protocol: ssl._SSLMethod = ssl.PROTOCOL_TLS_CLIENT) -> None:
        self.sessions: dict[str, ssl.SSLSession] = {}

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        if session is None and not server_side and isinstance(server_hostname, str):
            session = self.sessions.get(server_hostname)
        return super().wrap_bio(
            incoming, outgoing, server_side=server_side, server_hostname=server_hostname, session=session
        )

    def keep(self, connection: ssl.SSLObject) -> None:
        """Keep ``connection``'s session for the next connection to its server name, if it can be resumed."""
        name, session = connection.server_hostname, connection.session
        if name is None or session is None or not (session.has_ticket or session.id):
            return
        if name not in self.sessions and len(self.sessions) >= SESSIONS:
            del self.sessions[next(iter(self.sessions))]
        self.sessions[name] = session


_CONTEXTS: dict[tuple[TLSOptions, str | None, str | None], ssl.SSLContext] = {}


def context(options: TLSOptions, label: Callable[[str], str] = str) -> ssl.SSLContext:
    """The context for these settings; built once per process (and per ``SSL_CERT_FILE``/``SSL_CERT_DIR``)."""
    key = (options, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    found = _CONTEXTS.get(key)
    if found is None:
        found = _CONTEXTS[key] = _build(options, label)
    return found


def route_context(route: Route) -> ssl.SSLContext:
    """The context of a route's upstream; a file that does not load is named as the route's settings name it."""
    labels = dict(route.tls_labels)
    return context(TLSOptions.of(route), lambda setting: labels.get(setting) or f"route {route.name!r} {setting}")


def check(routes: Iterable[Route]) -> None:
    """Build the context of every https:// route now, so that a file that does not load stops the start (with
    ``ConfigError``) rather than a request; the relays then find them built (forked) or build them the same."""
    for route in routes:
        if route.upstream.startswith("https://"):
            route_context(route)


def _reason(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc).lower().replace("_", " ")
    return exc.strerror or str(exc)


def _no_password() -> bytes:
    return b""  # an encrypted key fails to load (named below) rather than prompting on the terminal


def _build(options: TLSOptions, label: Callable[[str], str]) -> ssl.SSLContext:
    ctx = ResumingContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the host name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    if not options.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if options.ca is not None:
        try:
            ctx.load_verify_locations(cafile=options.ca)
        except OSError as exc:
            raise ConfigError(f"{label('tls_ca')}: cannot load {options.ca!r}: {_reason(exc)}") from None
    if options.ca_dir is not None:
        if not os.path.isdir(options.ca_dir):
            raise ConfigError(f"{label('tls_ca_dir')}: {options.ca_dir!r} is not a directory")
        try:
            ctx.load_verify_locations(capath=options.ca_dir)
        except OSError as exc:
            raise ConfigError(f"{label('tls_ca_dir')}: cannot load {options.ca_dir!r}: {_reason(exc)}") from None
    if options.ca is None and options.ca_dir is None and options.verify:
        _default_roots(ctx)
    if options.cert is not None:
        for setting, path in (("tls_cert", options.cert), ("tls_key", options.key)):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{label(setting)}: cannot load {path!r}: no such file")
        try:
            ctx.load_cert_chain(options.cert, options.key, password=_no_password)
        except OSError as exc:
            files = repr(options.cert) if options.key is None else f"{options.cert!r} with {options.key!r}"
            what = label("tls_cert") if options.key is None else f"{label('tls_cert')}, {label('tls_key')}"
            raise ConfigError(f"{what}: cannot load {files}: {_reason(exc)}") from None
    elif options.key is not None:
        raise ConfigError(f"{label('tls_key')}: given without tls_cert")
    return ctx


def _default_roots(ctx: ssl.SSLContext) -> None:
    """OpenSSL's default paths (``SSL_CERT_FILE``, ``SSL_CERT_DIR`` honoured); certifi's when they hold nothing."""
    ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if ctx.cert_store_stats()["x509_ca"]:
        return
    paths = ssl.get_default_verify_paths()
    # A directory's certificates are read when needed, so they are not counted above: look into it.
    if paths.capath and os.path.isdir(paths.capath) and os.listdir(paths.capath):
        return
    import certifi

    ctx.load_verify_locations(cafile=certifi.where())


def describe(exc: OSError) -> str:
    """A TLS failure in words: what failed, and OpenSSL's reason."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message or _reason(exc)}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {_reason(exc)}"
    return str(exc)
