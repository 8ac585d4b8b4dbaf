"""``llmtap.relay.upstream.errors`` and the relay's answer to each (``llmtap.relay.answers.upstream_failed``).

Each failure before the response's head gets the status, error type, message and tape marks it always had: the
names in them (``ReadTimeout``, ``ConnectError``) are each class's ``label``, whatever the class is called.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import MutableMapping
from typing import Any

import pytest

from llmtap.config.types import Route
from llmtap.errors import LlmtapError
from llmtap.relay.answers import upstream_failed
from llmtap.relay.upstream import errors
from llmtap.wire.tape import Tape

ROUTE = Route(prefix="/", upstream="http://up.test", name="r")

#: Error, status, error type in the body, the body's message, the tape's error type and message, the log line.
CASES: list[tuple[errors.UpstreamError, int, str, str, str, str, bool]] = [
    (
        errors.ConnectFailed("up.test:80: [Errno 111] Connection refused"),
        502,
        "upstream_unreachable",
        "upstream http://up.test unreachable: up.test:80: [Errno 111] Connection refused",
        "upstream_unreachable",
        "up.test:80: [Errno 111] Connection refused",
        True,
    ),
    (
        errors.ConnectTimeout("no connection to up.test:80 within 1 s"),
        504,
        "upstream_timeout",
        "upstream http://up.test timed out (ConnectTimeout: no connection to up.test:80 within 1 s)",
        "connect_timeout",
        "upstream timed out: ConnectTimeout",
        True,
    ),
    (
        errors.ReadTimeout("upstream sent nothing for 5 s"),
        504,
        "upstream_timeout",
        "upstream http://up.test timed out (ReadTimeout: upstream sent nothing for 5 s)",
        "timeout",
        "upstream timed out: ReadTimeout",
        True,
    ),
    (
        errors.PoolTimeout("no upstream connection free within 2 s"),
        504,
        "upstream_timeout",
        "upstream http://up.test timed out (PoolTimeout: no upstream connection free within 2 s)",
        "timeout",
        "upstream timed out: PoolTimeout",
        True,
    ),
    (
        errors.WriteTimeout("upstream took no request body for 3 s"),
        504,
        "upstream_timeout",
        "upstream http://up.test timed out (WriteTimeout: upstream took no request body for 3 s)",
        "timeout",
        "upstream timed out: WriteTimeout",
        True,
    ),
    (
        errors.UpstreamClosed("upstream closed the connection before the response headers"),
        502,
        "upstream_closed",
        "upstream http://up.test closed the connection: upstream closed the connection before the response headers",
        "upstream_closed",
        "upstream closed the connection before the response headers",
        True,
    ),
    (
        errors.UpstreamReset("upstream reset the connection: [Errno 104] Connection reset by peer"),
        502,
        "upstream_closed",
        "upstream http://up.test closed the connection: upstream reset the connection: [Errno 104] Connection reset"
        " by peer",
        "upstream_closed",
        "upstream reset the connection: [Errno 104] Connection reset by peer",
        True,
    ),
    (
        errors.BadHead("malformed response from upstream: Invalid status code"),
        502,
        "upstream_protocol_error",
        "upstream http://up.test sent a response llmtap cannot relay faithfully: malformed response from upstream:"
        " Invalid status code",
        "upstream_protocol_error",
        "malformed response from upstream: Invalid status code",
        False,
    ),
]


async def answer(exc: errors.UpstreamError) -> tuple[list[MutableMapping[str, Any]], Tape, bool]:
    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    tape = Tape(1, method="POST", path="/", inner_path="/", route="r", protocol=None, received=0.0, received_wall_ns=0)
    head = await upstream_failed(send, ROUTE, tape, exc)
    return sent, tape, head


@pytest.mark.parametrize("case", CASES, ids=lambda case: type(case[0]).__name__)
def test_each_failure_is_answered_as_before(
    case: tuple[errors.UpstreamError, int, str, str, str, str, bool], caplog: pytest.LogCaptureFixture
) -> None:
    exc, status, kind, message, tape_kind, tape_message, logged = case
    with caplog.at_level(logging.WARNING, logger="llmtap.proxy"):
        sent, tape, head = asyncio.run(answer(exc))
    assert sent[0]["status"] == status
    body = json.loads(sent[1]["body"])
    assert body == {"error": {"type": kind, "message": message, "code": status}}
    assert (tape.error_type, tape.error_message) == (tape_kind, tape_message)
    # A head that cannot be read is the caller's to log (rate-limited); every other failure is logged here.
    assert head is isinstance(exc, errors.BadHead)
    assert [r.getMessage() for r in caplog.records] == ([message] if logged else [])


def test_the_family_is_llmtaps_own() -> None:
    for name in errors.__all__:
        kind = getattr(errors, name)
        assert issubclass(kind, errors.UpstreamError) and issubclass(kind, LlmtapError), name
    assert not issubclass(errors.UpstreamError, OSError)
    for timeout in (errors.ConnectTimeout, errors.PoolTimeout, errors.ReadTimeout, errors.WriteTimeout):
        assert issubclass(timeout, errors.UpstreamTimeout)
        assert timeout.label == timeout.__name__
    assert issubclass(errors.BadHead, errors.UpstreamProtocolError)
