"""A request as the raw upstreams here read it off an asyncio stream: the head parsed, the body whole (by its
Content-Length, or chunked), so each upstream answers it however its script says."""

from __future__ import annotations

import asyncio

__all__ = ["parse_head", "read_body"]


def parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """The method, the target and the headers (names lower-cased) of a request head ending in a blank line."""
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return method, target, headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """The request's body: ``content-length`` bytes, the chunks of a chunked one joined, or none."""
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() != "chunked":
        return b""
    out = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return bytes(out)
        out += data[:-2]
