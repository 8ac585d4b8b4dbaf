"""What the record journal costs: ``python -m bench.probes.journal [--requests N] [--chunks N] [--dir DIR]``.

The telemetry side's part, measured in place of the whole process (whose figures on a shared machine drown a few
microseconds): the tapes of ``--requests`` streamed chat requests of ``--chunks`` chunks each, their frames as a
relay's channel sends them, handed to a ``Spool`` as the telemetry process's intake does (``append``: one write of
the frames one read gave, ``--batch`` requests a read), then each request's end taken, emitted and given to a file
sink that settles it, and ``poll`` once per batch (what the recorder's worker does). Prints one JSON line: CPU
microseconds per chunk and per request of each part, and the bytes journaled per request. The relay's part is a
few stores into a memory-mapped ledger per request (``Ledger.in_flight`` twice, ``handed`` once): timed too.
The journal's folder is ``--dir`` (default: a temporary folder, on whatever disk holds it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from llmtap.telemetry.journal.spool import Spool
from llmtap.wire.framing import encode_frame
from llmtap.wire.ledger import Ledger
from llmtap.worker import Progress
from tests.support.tapes import chat_tape

EVENT = b'data: {"id":"c","model":"m","choices":[{"index":0,"delta":{"content":" word"}}]}\n\n'


class _Files:
    """A sink that has every record at once (the file sink, once it wrote its lines)."""

    kind = "files"

    def __init__(self) -> None:
        self.progress = Progress()


def _batches(requests: int, chunks: int, batch: int) -> list[tuple[bytes, list[tuple[Any, ...]]]]:
    out = []
    for start in range(0, requests, batch):
        messages: list[tuple[Any, ...]] = []
        for key in range(start + 1, min(start + batch, requests) + 1):
            messages += chat_tape(key, [EVENT] * chunks)[1]
        raw = b"".join(b"".join(encode_frame(m)) for m in messages)
        out.append((raw, messages))
    return out


def measure(folder: Path, requests: int, chunks: int, batch: int) -> dict[str, Any]:
    """One run: the journal's work on the intake's thread and on the worker's, per chunk and per request."""
    sink = _Files()
    spool = Spool(folder, [sink])
    batches = _batches(requests, chunks, batch)
    appended = worked = 0.0
    for raw, messages in batches:
        t0 = time.process_time()
        spool.append(0, raw, messages)
        t1 = time.process_time()
        for message in messages:
            if message[0] == 2:  # an end: the recorder's worker made its record
                ref = spool.ended(0, message[1])
                spool.emitted(ref)
                spool.track(ref, 0, sink.progress.given)
                sink.progress.settle_now()
        spool.poll()
        t2 = time.process_time()
        appended += t1 - t0
        worked += t2 - t1
    size = sum(len(raw) for raw, _ in batches)
    spool.close()
    ledger = Ledger(folder, 1, 1)
    t0 = time.process_time()
    for i in range(requests):
        ledger.in_flight(1)
        ledger.handed(0, i)
        ledger.in_flight(0)
    relay = time.process_time() - t0
    ledger.close()
    n = requests * chunks
    return {
        "requests": requests,
        "chunks_per_request": chunks,
        "requests_per_read": batch,
        "bytes_per_request": round(size / requests),
        "intake_us_per_chunk": round(appended / n * 1e6, 3),
        "worker_us_per_chunk": round(worked / n * 1e6, 3),
        "intake_us_per_request": round(appended / requests * 1e6, 2),
        "worker_us_per_request": round(worked / requests * 1e6, 2),
        "relay_ledger_us_per_request": round(relay / requests * 1e6, 3),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.probes.journal", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--chunks", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="requests whose frames one read of the socket gives")
    p.add_argument("--dir", type=Path, help="the journal's folder (default: a temporary one)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="journal-", dir=args.dir) as folder:
        print(json.dumps(measure(Path(folder), args.requests, args.chunks, args.batch)))


if __name__ == "__main__":
    main()
