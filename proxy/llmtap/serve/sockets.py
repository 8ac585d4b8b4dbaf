"""The listeners, bound before any process starts: a taken port fails at once, with its address."""

from __future__ import annotations

import contextlib
import os
import socket

from llmtap.config.types import ConfigError

__all__ = ["bind", "bind_unix", "channel_paths", "facts_paths"]


def bind(host: str, port: int, what: str, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A listening socket, or ``ConfigError`` naming the address when it is taken.

    ``reuse_port``: several processes bind the same port and the kernel spreads new connections over
    them (SO_REUSEPORT; only sockets of the same user can join).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then; without it Nagle
    # can hold a small SSE write until the client's delayed ACK, up to 40 ms later.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{what} {host}:{port}: {exc.strerror or exc}") from None
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def bind_unix(path: str) -> socket.socket:
    """A listening Unix socket at ``path`` (a worker's private admin endpoint), readable by its owner only."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


def channel_paths(base: str, count: int) -> list[str]:
    """The channel sockets of ``count`` telemetry processes: ``base`` itself for one."""
    return [base] if count == 1 else [f"{base}.{i}" for i in range(count)]


def facts_paths(base: str, count: int) -> tuple[str, ...]:
    """The sockets on which each of ``count`` telemetry processes takes the others' lessons (none for one)."""
    return tuple(f"{base}.facts.{i}" for i in range(count)) if count > 1 else ()
