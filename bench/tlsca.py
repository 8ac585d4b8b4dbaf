"""The benchmark's private certificate authority: a CA and a server certificate made at run time (``trustme``).

The server certificate names ``localhost`` and ``127.0.0.1``, so a client may check either (nginx checks
the name it sends as SNI, ``localhost``; llmtap and the load client check the IP of the URL). Nothing is
written outside the run's folder and the keys live only as long as the run's files.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

#: The name nginx sends as SNI and checks the certificate against (``proxy_ssl_name``).
SERVER_NAME = "localhost"


@dataclass(frozen=True)
class Certs:
    """Files of one run's CA: the CA certificate (what clients trust) and the server's key and chain."""

    ca: Path
    cert: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts only this CA and checks host names."""
        return ssl.create_default_context(cafile=str(self.ca))

    def server_context(self) -> ssl.SSLContext:
        """The upstream's server context."""
        return server_context(self.cert, self.key)


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A TLS server context from a PEM chain and key."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def make(folder: Path) -> Certs:
    """A new CA and a server certificate for ``localhost`` and ``127.0.0.1``, as PEM files in ``folder``."""
    import trustme

    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="llmtap bench CA")
    leaf = ca.issue_cert(SERVER_NAME, "127.0.0.1")
    certs = Certs(ca=folder / "ca.pem", cert=folder / "server.pem", key=folder / "server.key")
    ca.cert_pem.write_to_path(str(certs.ca))
    # The chain (leaf first) and the key apart: nginx, uvloop and Python's ssl all read these.
    with certs.cert.open("wb") as f:
        for blob in leaf.cert_chain_pems:
            f.write(blob.bytes())
    leaf.private_key_pem.write_to_path(str(certs.key))
    certs.key.chmod(0o600)
    return certs
