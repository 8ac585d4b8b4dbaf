"""What a short answer's way out to the client costs: ``python -m bench.probes.oneshot``.

A non-streamed answer read whole (an embeddings call's 160 bytes with their Content-Length) goes to the client
either as the relay sends a stream, through uvicorn's ASGI ``send`` (the head, the body part, the end), or written
at once (``llmtap.relay.oneshot``: its head built as uvicorn builds it, one ``transport.write``). This measures
both on uvicorn's own request cycle over a transport that sends each write on a socket pair at once (as the loop's
transport does while the socket takes everything), in process CPU time per answer, the cycle's making and the
client end's reads measured alone and taken off: medians of several rounds, the two ways alternating. Then, for
the same request, what its tape (made, its one read and delivery, its end message) and its frame's encoding cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import statistics
import time
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from llmtap.relay.oneshot import head_of, write_whole
from llmtap.wire.framing import encode_frames
from llmtap.wire.tape import Tape

BODY = b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2,0.3]}],"model":"m","usage":{}}'
HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(BODY)).encode()),
    (b"date", b"Mon, 07 Dec 2026 08:00:00 GMT"),
    (b"server", b"fixed"),
]
SCOPE: Any = {"type": "http", "method": "POST", "http_version": "1.1", "path": "/v1/embeddings"}


class _Transport:
    """Writes as the event loop's transport does when the socket takes everything: one ``send`` each."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def write(self, data: bytes) -> None:
        if data:  # as the loop's transports: an empty write is no send
            self.sock.send(data)

    def writelines(self, parts: Any) -> None:
        self.sock.sendmsg(list(parts))

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


#: The client's end of the connection, read empty every ``_DRAIN_EVERY`` answers (alike both ways).
_PAIR = socket.socketpair()
_DRAIN_EVERY = 64


def _drain(i: int) -> None:
    if i % _DRAIN_EVERY == 0:
        _PAIR[1].setblocking(False)
        try:
            while _PAIR[1].recv(1 << 20):
                pass
        except BlockingIOError:
            pass


def _cycle() -> RequestResponseCycle:
    transport: Any = _Transport(_PAIR[0])
    return RequestResponseCycle(
        scope=SCOPE,
        transport=transport,
        flow=FlowControl(transport),
        logger=logging.getLogger("bench.oneshot"),
        access_logger=logging.getLogger("bench.oneshot.access"),
        access_log=False,
        default_headers=[(b"server", b"uvicorn")],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=True,
        on_response=lambda: None,
    )


async def _through_send(answers: int) -> float:
    started = time.process_time()
    for i in range(answers):
        _drain(i)
        send = _cycle().send
        await send({"type": "http.response.start", "status": 200, "headers": list(HEADERS)})
        await send({"type": "http.response.body", "body": BODY, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return (time.process_time() - started) / answers


async def _cycle_alone(answers: int) -> float:
    started = time.process_time()
    for i in range(answers):
        _drain(i)
        _cycle()
    return (time.process_time() - started) / answers


async def _at_once(answers: int) -> float:
    started = time.process_time()
    for i in range(answers):
        _drain(i)
        cycle = _cycle()
        whole = head_of(cycle, 200, list(HEADERS), len(BODY))
        assert whole is not None
        write_whole(cycle, whole, 200, BODY)
    return (time.process_time() - started) / answers


def _tape() -> Tape:
    """A one-read request's tape as the relay fills it."""
    tape = Tape(
        1,
        method="POST",
        path="/v1/embeddings",
        inner_path="/v1/embeddings",
        route="default",
        protocol="openai",
        received=1.0,
        received_wall_ns=1,
    )
    tape.body = b'{"input":"hello world","model":"text-embedding-3-small"}'
    tape.status_code = 200
    tape.response_headers = list(HEADERS)
    tape.read(2.0, BODY)
    tape.delivered(2.1)
    tape.end = 2.2
    return tape


def _tapes(answers: int, encode: bool) -> float:
    started = time.process_time()
    for _ in range(answers):
        message = _tape().end_message(0, 1)
        if encode:
            encode_frames(message)
    return (time.process_time() - started) / answers


def tape_cost(answers: int, rounds: int) -> dict[str, Any]:
    """Median CPU µs of a one-read request's tape (made, filled, its end message built) and of its frame."""
    built = [_tapes(answers, False) for _ in range(rounds)]
    framed = [_tapes(answers, True) for _ in range(rounds)]
    return {
        "tape_us_per_request": round(statistics.median(built) * 1e6, 2),
        "frame_us_per_request": round((statistics.median(framed) - statistics.median(built)) * 1e6, 2),
    }


def measure(answers: int, rounds: int) -> dict[str, Any]:
    """Median CPU µs per answer each way, the making of the cycle (measured alone) taken off both."""
    made: list[float] = []
    send: list[float] = []
    once: list[float] = []
    for _ in range(rounds):
        made.append(asyncio.run(_cycle_alone(answers)))
        send.append(asyncio.run(_through_send(answers)))
        once.append(asyncio.run(_at_once(answers)))
    cycle = statistics.median(made)
    return {
        "answers": answers,
        "rounds": rounds,
        "asgi_send_us_per_answer": round((statistics.median(send) - cycle) * 1e6, 2),
        "at_once_us_per_answer": round((statistics.median(once) - cycle) * 1e6, 2),
        "note": "each write one send() on a socketpair; the making of the cycle and the draining taken off",
    }


def main(argv: list[str] | None = None) -> None:
    """Print both ways' CPU per answer, then what the answer's tape and its frame cost."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.oneshot", description=__doc__)
    p.add_argument("--answers", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.answers, args.rounds)))
    print(json.dumps(tape_cost(args.answers, args.rounds)))


if __name__ == "__main__":
    main()
