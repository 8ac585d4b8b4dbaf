"""The listeners, bound before any process starts: a taken port fails at once, with its address."""

from __future__ import annotations

import contextlib
import errno
import os
import socket

from llmtap.config.options import OPTIONS
from llmtap.config.types import ConfigError

__all__ = ["ADMIN_LISTENER", "PROXY_LISTENER", "bind", "bind_failure", "bind_unix", "channel_paths", "facts_paths"]


#: The option names (``llmtap.config.options``) of each listener's address and port: a failed bind names them.
PROXY_LISTENER = ("host", "port")
ADMIN_LISTENER = ("admin_host", "admin_port")


def bind(
    host: str,
    port: int,
    what: str,
    *,
    reuse_port: bool = False,
    listen: bool = True,
    options: tuple[str, str] | None = None,
    alone: bool = False,
) -> socket.socket:
    """A listening socket, or ``ConfigError`` naming the address when it is taken.

    ``reuse_port``: several processes bind the same port and the kernel spreads new connections over
    them (SO_REUSEPORT; only sockets of the same user can join). ``alone``: with ``reuse_port``, refuse a port that
    another server's sockets already share that way (a second ``llmtap serve --workers N`` on the same port would
    bind it too, and quietly take part of the first one's connections). ``options``: the names of the settings of
    this address and port, which the error tells how to change.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if alone and reuse_port and port:
        # A socket without SO_REUSEPORT cannot bind beside a listening one, whatever that one set.
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise ConfigError(bind_failure(what, host, port, exc, options)) from None
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
        raise ConfigError(bind_failure(what, host, port, exc, options)) from None
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def bind_failure(what: str, host: str, port: int, exc: OSError, options: tuple[str, str] | None) -> str:
    """One line: the address, the system's reason, and (for a known listener) the setting to change, in each of
    the three places a setting can be given (flag, variable, file key)."""
    message = f"{what} {host}:{port}: {exc.strerror or exc}"
    if options is None:
        return message
    host_option, port_option = (OPTIONS[name] for name in options)
    if exc.errno == errno.EADDRINUSE:
        why, option, change = "another process listens there (a second llmtap serve?)", port_option, "another port"
    elif exc.errno == errno.EACCES:
        why, option, change = "ports below 1024 need privileges", port_option, "a port from 1024"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why, option, change = "no interface of this machine has that address", host_option, "another address"
    else:
        return message
    return f"{message}: {why}; give {change} with {where_set(option.flag, option.env, option.key)}"


def where_set(flag: str | None, env: str | None, key: str | None) -> str:
    """``--port, LLMTAP_PORT or listen.port in the --config file``."""
    places = [p for p in (flag, env) if p] + ([f"{key} in the --config file"] if key else [])
    return ", ".join(places[:-1]) + f" or {places[-1]}" if len(places) > 1 else places[0]


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
