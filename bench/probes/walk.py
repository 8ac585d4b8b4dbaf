"""A request's walk through the relay: ``python -m bench.probes.walk [--inject-usage] [--pairs]``.

Serves the relay in this process (llmtap's listener, a loopback upstream; ``tests.support.walk``), warms it, then
prints, for one non-streamed and one streamed request, how many times control entered each of llmtap's modules
from another llmtap module (the request's tasks; a coroutine resumed is not a new entry), with ``--pairs`` who
entered it, and apart the entries the upstream's read callbacks made and the body parts handed to the sink.
``tests/relay/test_walk.py`` holds the relay's modules to at most two.
"""

from __future__ import annotations

import argparse

from tests.support.walk import Walk, relay_walk


def report(name: str, walk: Walk, pairs: bool) -> None:
    print(f"{name}:")
    for module, count in sorted(walk.entries.items()):
        print(f"  {count:3d}  {module}")
        if pairs:
            for (caller, callee), n in sorted(walk.pairs.items()):
                if callee == module:
                    print(f"         {n:3d} from {caller}")
    print(f"  read callbacks: {sum(walk.reads.values())} entries; parts to the sink from the task: {walk.parts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.walk", description=__doc__.split("\n")[0])
    parser.add_argument("--inject-usage", action="store_true", help="splice the usage request in (a stream's filter)")
    parser.add_argument("--pairs", action="store_true", help="say which module entered each")
    args = parser.parse_args(argv)
    walks = relay_walk(inject_usage=args.inject_usage)
    report("non-streamed", walks.plain, args.pairs)
    report("streamed", walks.streamed, args.pairs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
