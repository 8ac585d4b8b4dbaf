"""API-key fingerprints: a short keyed hash of the credential a request carries, made in the relay.

The relay is the one process that holds the caller's key anyway (it forwards it); hashing it here, once per
request (a keyed BLAKE2b of some 50 bytes, about a microsecond), means the key itself never crosses the
channel to the telemetry process, nor sits in a tape. A keyed hash, not a plain one: without the secret, a
fingerprint cannot be checked against a list of leaked keys.

The secret is the operator's (``LLMTAP_ATTRIBUTION_KEY``, or the file ``--attribution-key-file`` names), else the
install's: made at first start and kept in ``$XDG_STATE_HOME/llmtap/attribution.key`` (``~/.local/state`` by
default), so fingerprints stay the same across restarts and between the relay processes of one install. Where that
file cannot be written (a read-only root), a secret is made for the process, and the log says fingerprints change
at restart; replicas share fingerprints only when given one secret (the chart's attribution values).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from pathlib import Path

__all__ = ["FINGERPRINT_CHARS", "KEY_HEADERS", "Fingerprints", "fingerprint", "install_secret"]

log = logging.getLogger("llmtap.relay")

#: Headers that carry a caller's credential: OpenAI-compatible and Azure, Anthropic, Gemini.
KEY_HEADERS = frozenset({b"authorization", b"api-key", b"x-api-key", b"x-goog-api-key"})
#: Hex characters of a fingerprint (48 bits: enough to tell a fleet's keys apart, too short to be a key).
FINGERPRINT_CHARS = 12
_SCHEMES = (b"bearer ", b"basic ")


def fingerprint(secret: bytes, value: bytes) -> str:
    """The fingerprint of a credential header's value (``Bearer`` or ``Basic`` and spaces aside)."""
    token = value.strip()
    lowered = token[:7].lower()
    for scheme in _SCHEMES:
        if lowered.startswith(scheme):
            token = token[len(scheme) :].strip()
            break
    return hashlib.blake2b(token, key=secret[:64], digest_size=FINGERPRINT_CHARS // 2).hexdigest()


def state_dir() -> Path:
    """Where llmtap keeps what an install remembers (``$XDG_STATE_HOME/llmtap``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "llmtap"


def install_secret(directory: Path | None = None) -> bytes:
    """The install's fingerprint secret, made once (atomically: the first process of a start makes it)."""
    folder = directory or state_dir()
    path = folder / "attribution.key"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            # Another process of this start may have made it a moment ago and be writing it still.
            for _ in range(50):
                secret = path.read_bytes().strip()
                if len(secret) >= 16:
                    return secret
                time.sleep(0.01)
            raise OSError(f"{path} holds fewer than 16 bytes") from None
        secret = secrets.token_hex(32).encode()
        with os.fdopen(fd, "wb") as f:
            f.write(secret + b"\n")
        return secret
    except OSError as exc:
        log.warning(
            "API-key fingerprints: cannot keep a secret in %s (%s); this process made its own, so fingerprints "
            "change at restart and differ between replicas (to keep them, give every replica the same secret: "
            "LLMTAP_ATTRIBUTION_KEY, or a file named by --attribution-key-file, LLMTAP_ATTRIBUTION_KEY_FILE or "
            "attribution.key_file in the config file; the Helm chart's attribution.key or attribution.existingSecret)",
            path,
            exc,
        )
        return secrets.token_bytes(32)


class Fingerprints:
    """The relay's fingerprints of the API keys it sees: the operator's secret, else the install's, read (or made)
    at the first key seen, once per process."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret

    def of(self, value: bytes) -> str:
        """The fingerprint of a credential header's value."""
        if self._secret is None:
            self._secret = install_secret()
        return fingerprint(self._secret, value)
