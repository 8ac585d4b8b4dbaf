"""The listener's connection addresses: what uvicorn's own helpers report, read the cheaper way, on real sockets.

``BoundedHeadProtocol`` sets ``server`` and ``client`` (the scope's ``server`` and ``client``, the address the
per-client bound counts) from the transport's ``sockname`` and ``peername`` instead of uvicorn's
``get_local_addr`` and ``get_remote_addr``: the same values, checked here on uvloop and asyncio, over IPv4, IPv6
and a Unix socket.
"""

from __future__ import annotations

import asyncio
import socket
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop
from uvicorn.protocols.utils import get_local_addr, get_remote_addr

from llmtap.listener import local_address, peer_address

Seen = list[tuple[Any, Any, Any, Any]]


class _Record(asyncio.Protocol):
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t: Any = transport
        self.seen.append((local_address(t), get_local_addr(t), peer_address(t), get_remote_addr(t)))
        transport.close()


async def _tcp(host: str, seen: Seen) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Record(seen), host, 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection(host, port)
    await reader.read()
    writer.close()
    server.close()


async def _unix(seen: Seen) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "s")
        server = await asyncio.get_running_loop().create_unix_server(lambda: _Record(seen), path)
        reader, writer = await asyncio.open_unix_connection(path)
        await reader.read()
        writer.close()
        server.close()


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


RUNNERS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"uvloop": uvloop.run, "asyncio": asyncio.run}


@pytest.mark.parametrize("loop", sorted(RUNNERS))
def test_tcp_addresses_are_uvicorns(loop: str) -> None:
    seen: Seen = []
    RUNNERS[loop](_tcp("127.0.0.1", seen))
    assert len(seen) == 1
    ours_local, theirs_local, ours_peer, theirs_peer = seen[0]
    assert ours_local == theirs_local and ours_local[0] == "127.0.0.1" and isinstance(ours_local[1], int)
    assert ours_peer == theirs_peer and ours_peer[0] == "127.0.0.1" and ours_peer[1] != ours_local[1]


@pytest.mark.parametrize("loop", sorted(RUNNERS))
def test_ipv6_addresses_are_host_and_port_as_uvicorns(loop: str) -> None:
    if not _ipv6():
        pytest.skip("no IPv6 loopback on this machine")
    seen: Seen = []
    RUNNERS[loop](_tcp("::1", seen))
    ours_local, theirs_local, ours_peer, theirs_peer = seen[0]
    assert ours_local == theirs_local and ours_local[0] == "::1" and len(ours_local) == 2
    assert ours_peer == theirs_peer and ours_peer[0] == "::1" and len(ours_peer) == 2


@pytest.mark.parametrize("loop", sorted(RUNNERS))
def test_unix_socket_addresses_are_uvicorns(loop: str) -> None:
    seen: Seen = []
    RUNNERS[loop](_unix(seen))
    ours_local, theirs_local, ours_peer, theirs_peer = seen[0]
    assert ours_local == theirs_local and ours_local[0].endswith("/s") and ours_local[1] is None
    assert ours_peer == theirs_peer
