"""Fixtures the relay's tests share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    """Runs a scenario to its end on a fresh loop of the kind the parameter names: the relay runs on uvloop, and on
    asyncio's own loop where uvloop is not installed."""

    def go(scenario: Coroutine[Any, Any, None]) -> None:
        if request.param == "uvloop":
            uvloop.run(scenario)
        else:
            asyncio.run(scenario)

    return go
