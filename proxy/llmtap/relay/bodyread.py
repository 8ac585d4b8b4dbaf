"""The request body as the relay reads it: up to the inspect limit whole, the rest streamed upstream as it comes.

A body the usage splice may change is read by ``llmtap.providers.bodyscan`` as its pieces arrive, once it passes
``SCAN_FROM`` bytes, so that nothing is left to parse once its last byte came: a body of megabytes never holds the
event loop for the milliseconds ``json.loads`` takes on it. A piece that takes the reader long gives the
loop a turn every ``SCAN_SLICE`` bytes. A smaller body is parsed at the end, by one ``json.loads``
(``Provider.prepare``), which is quicker for it.

Nor is a large body ever joined into one buffer on the relay (a copy of milliseconds, most of it the kernel
mapping fresh pages): it stays the pieces it came in (``Body``), goes upstream as them (``spliced``: with the
usage splice between two of them) and to the telemetry process as them, in a frame of its own
(``llmtap.wire.framing``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from llmtap.errors import ClientGone, LlmtapError
from llmtap.providers.bodyscan import BodyScan
from llmtap.relay.oneshot import MIRRORED
from llmtap.types import Receive

__all__ = ["SCAN_FROM", "Body", "RequestTooLarge", "UploadStalled", "body_of", "prepend", "read_body", "spliced"]

#: A request body as read: its bytes, or past ``SCAN_FROM`` the pieces it came in, in order.
Body = bytes | tuple[bytes, ...]

#: A body past this many bytes is read by ``BodyScan`` as it arrives (below it, ``json.loads`` takes a millisecond
#: or less).
SCAN_FROM = 256 * 1024
#: Bytes of a piece the reader takes at once, and the time after which it gives the loop a turn.
SCAN_SLICE = 16 * 1024
SCAN_TURN = 0.001


class RequestTooLarge(LlmtapError):
    """The request body grew past ``max_request_bytes`` while it was being read."""


class UploadStalled(LlmtapError):
    """A request body still arriving while its request holds an admission slot fell silent too long."""


async def read_body(
    receive: Receive, limit: int, most: int, silence: float | None = None, scan: BodyScan | None = None
) -> tuple[Body, AsyncIterator[bytes] | None]:
    """Read the body up to ``limit`` bytes; past it, return what was read and an iterator over the rest.

    A body past ``most`` bytes (``max_request_bytes``; possible only without Content-Length) raises
    ``RequestTooLarge``, here or from the iterator while the rest streams upstream. The iterator raises
    ``UploadStalled`` when the client sends nothing for ``silence`` seconds (None: only the server's own body
    timeout applies). ``scan`` reads the body's pieces once it passes ``SCAN_FROM`` bytes (``scan.fed``: it did).
    """
    parts: list[bytes] = []
    size = fed = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            parts.append(chunk)
            size += len(chunk)
            if size > most:
                raise RequestTooLarge
            if scan is not None and SCAN_FROM < size <= limit:
                for part in parts[fed:]:
                    await _scan(scan, part)
                fed = len(parts)
        if not message.get("more_body", False):
            return _body(parts, size), None
        if size > limit:
            return _body(parts, size), _rest_of_body(receive, most - size, silence)


def body_of(cycle: Any, most: int) -> bytes | None:
    """The request's body, taken from the server's cycle at once when it all came with its head (its end read) and
    is at most ``most`` bytes, leaving the cycle as uvicorn's ``receive`` of it would (the body taken, reading
    resumed, the event cleared): a short request's body without ``receive``'s coroutine and its event's wait. None:
    the relay ``receive``s it as before (a body still arriving or larger, a client gone, a ``100-continue`` to
    answer first, or a uvicorn whose cycle this does not mirror)."""
    if (
        not MIRRORED  # the cycle as uvicorn 0.53 and later makes it, as ``llmtap.relay.oneshot`` writes to it
        or cycle.more_body
        or cycle.disconnected
        or cycle.response_complete
        or cycle.waiting_for_100_continue
        or len(cycle.body) > most
    ):
        return None
    body = bytes(cycle.body)
    cycle.body = bytearray()
    cycle.flow.resume_reading()
    cycle.message_event.clear()
    return body


def _body(parts: list[bytes], size: int) -> Body:
    return tuple(parts) if size > SCAN_FROM else parts[0] if len(parts) == 1 else b"".join(parts)


def spliced(body: Body, at: int, added: bytes) -> tuple[bytes | memoryview, ...]:
    """``body``'s pieces with ``added`` between its bytes before ``at`` and those from it: nothing copied."""
    parts = (body,) if isinstance(body, bytes) else body
    out: list[bytes | memoryview] = []
    start = 0
    for i, part in enumerate(parts):
        end = start + len(part)
        if start <= at <= end:
            view = memoryview(part)
            out += [view[: at - start], added, view[at - start :]]
            out += parts[i + 1 :]
            return tuple(p for p in out if len(p))
        out.append(part)
        start = end
    raise ValueError(f"splice at {at} past the body's {start} bytes")


async def _scan(scan: BodyScan, piece: bytes) -> None:
    """``scan.feed(piece)``, a slice at a time, with a turn of the loop whenever slices took ``SCAN_TURN``."""
    if len(piece) <= SCAN_SLICE:
        scan.feed(piece)
        return
    began = time.perf_counter()
    view = memoryview(piece)
    for at in range(0, len(piece), SCAN_SLICE):
        scan.feed(bytes(view[at : at + SCAN_SLICE]))
        if time.perf_counter() - began > SCAN_TURN:
            await asyncio.sleep(0)
            began = time.perf_counter()


async def _rest_of_body(receive: Receive, room: int, silence: float | None = None) -> AsyncIterator[bytes]:
    """The rest of a large body as it arrives; ``RequestTooLarge`` once it outgrows ``room`` bytes,
    ``UploadStalled`` when nothing arrives for ``silence`` seconds.

    Only the time spent waiting on the client counts: while the upstream is slow to take the body, this
    iterator is not being read and no timer runs.
    """
    while True:
        if silence is None:
            message = await receive()
        else:
            try:
                async with asyncio.timeout(silence):
                    message = await receive()
            except TimeoutError:
                raise UploadStalled from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            room -= len(chunk)
            if room < 0:
                raise RequestTooLarge
            yield chunk
        if not message.get("more_body", False):
            return


async def prepend(first: Body, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``first`` (its pieces), then what ``rest`` yields."""
    for part in (first,) if isinstance(first, bytes) else first:
        if part:
            yield part
    async for chunk in rest:
        yield chunk
