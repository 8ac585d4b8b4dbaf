"""``exchange._current_task``: the exchange's task, asked of the relay's loop, and found anyway when that loop is not
the one running (a relay started on one loop and called on another, as some tests do)."""

from __future__ import annotations

import asyncio

from llmtap.relay.exchange import _current_task


def test_the_task_is_found_on_the_relays_loop_and_without_it() -> None:
    other = asyncio.new_event_loop()
    try:

        async def main() -> None:
            task = asyncio.current_task()
            assert task is not None
            assert _current_task(asyncio.get_running_loop()) is task
            assert _current_task(None) is task
            assert _current_task(other) is task  # a loop not running here: the running one's task

        asyncio.run(main())
    finally:
        other.close()
