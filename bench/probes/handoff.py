"""What handing a read's messages to the recorder's worker costs: ``python -m bench.probes.handoff``.

The telemetry process reads the relay's channel and queues each message for the recorder's worker thread. At
thousands of short requests a second a read carries the ends of several requests; queued one by one, each costs
a hold of the queue's lock and a notification, and each may wake the worker. This measures the process's CPU
per message (both threads: ``time.process_time``) through the recorder's ``Inbox``, with a worker that takes
each item as the recorder's does and nothing more, for reads of ``--per-read`` messages queued one at a time
(``submit``) and all at once (``submit_all``), alternating, medians of several rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

from llmtap.telemetry.intake.inbox import STOP, Inbox
from tests.support.tapes import chat_tape


class _Quiet:
    """Drops and streams: nothing is turned away in this measurement (the queue holds every read)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _round(per_read: int, reads: int, together: bool) -> float:
    """µs of process CPU per message, for ``reads`` reads of ``per_read`` ends each."""
    inbox = Inbox(per_read * 4 + 64, _Quiet(), _Quiet(), lambda *a: None, lambda: None)  # type: ignore[arg-type]
    ends = [chat_tape(key, [b"data: [DONE]\n\n"])[1][-1] for key in range(per_read)]

    drained = threading.Event()

    def worker() -> None:
        q = inbox.queue
        while True:
            item = q.get()
            if item is STOP:
                return
            inbox.taken(item[2])
            if q.empty():
                drained.set()

    thread = threading.Thread(target=worker)
    thread.start()
    cpu = time.process_time()
    for _ in range(reads):
        if together:
            inbox.submit_all(ends)
        else:
            for message in ends:
                inbox.submit(message)
        # The next read comes once the worker took this one (the relay's next requests): it waits again.
        drained.wait()
        drained.clear()
    cpu = time.process_time() - cpu
    inbox.queue.put(STOP)
    thread.join()
    return 1e6 * cpu / (reads * per_read)


def main(argv: list[str] | None = None) -> None:
    """Print the medians (JSON)."""
    p = argparse.ArgumentParser(prog="python -m bench.probes.handoff", description=__doc__.splitlines()[0])
    p.add_argument("--per-read", type=int, default=4)
    p.add_argument("--reads", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    got: dict[str, list[float]] = {"one_by_one": [], "together": []}
    for _ in range(args.rounds):
        for name in got:
            got[name].append(_round(args.per_read, args.reads, name == "together"))
    print(json.dumps({"per_read": args.per_read, **{k: round(statistics.median(v), 2) for k, v in got.items()}}))


if __name__ == "__main__":
    main()
