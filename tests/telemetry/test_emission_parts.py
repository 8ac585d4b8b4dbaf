"""A batch-taking emitter (the metrics) records a batch ``LOOK_EVERY`` requests at a time, with looks at the relays
between: every request reaches every emitter once, in order; a part whose recording fails counts its own requests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from llmtap.telemetry import sched
from llmtap.telemetry.emit.batch import LOOK_EVERY, STAGED, Emission


class _Plain:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def emit(self, request: Any) -> None:
        self.log.append(("plain", request.n))


class _Part:
    def __init__(self, log: list[Any], fail: bool) -> None:
        self.log, self.fail = log, fail
        self.got: list[int] = []

    def emit(self, request: Any) -> None:
        self.got.append(request.n)

    def close(self) -> None:
        if self.fail:
            raise RuntimeError("recording failed")
        self.log.append(("recorded", tuple(self.got)))


class _Batching:
    """Takes a batch whole (``batch``), recording it when the batch is closed; ``fail_part`` fails that part's close."""

    def __init__(self, log: list[Any], fail_part: int | None = None) -> None:
        self.log, self.fail_part, self.parts = log, fail_part, 0

    def batch(self) -> _Part:
        self.parts += 1
        return _Part(self.log, self.parts - 1 == self.fail_part)

    def emit(self, request: Any) -> None:
        self.log.append(("alone", request.n))


def _requests(n: int) -> list[Any]:
    return [SimpleNamespace(n=i, tl=SimpleNamespace(method="POST", path="/v1/embeddings")) for i in range(n)]


@pytest.fixture
def looks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    log: list[Any] = []
    monkeypatch.setattr(sched, "checkpoint", lambda: log.append("look"))
    return log


def test_a_staged_batch_is_recorded_in_parts_each_request_once_in_order(looks: list[Any]) -> None:
    assert STAGED > LOOK_EVERY
    batching = _Batching(looks)
    emission = Emission([batching, _Plain(looks)], _Plain(looks))
    emission.emit(_requests(STAGED))
    recorded = [entry[1] for entry in looks if isinstance(entry, tuple) and entry[0] == "recorded"]
    assert [n for part in recorded for n in part] == list(range(STAGED))
    assert all(1 <= len(part) <= LOOK_EVERY for part in recorded)
    assert len(recorded) == -(-STAGED // LOOK_EVERY)
    assert [entry[1] for entry in looks if isinstance(entry, tuple) and entry[0] == "plain"] == list(range(STAGED))
    # A look at the relays right after each part's recording (before the next part's first request).
    for at, entry in enumerate(looks[:-1]):
        if isinstance(entry, tuple) and entry[0] == "recorded" and entry[1][-1] != STAGED - 1:
            assert looks[at + 1] == "look"
    assert emission.failed == 0


def test_a_part_of_one_request_goes_to_the_emitter_itself(looks: list[Any]) -> None:
    emission = Emission([_Batching(looks)], _Plain(looks))
    emission.emit(_requests(LOOK_EVERY + 1))
    tuples = [entry for entry in looks if isinstance(entry, tuple)]
    assert tuples == [("recorded", tuple(range(LOOK_EVERY))), ("alone", LOOK_EVERY)]


def test_a_part_that_fails_to_record_counts_its_requests_only(looks: list[Any]) -> None:
    emission = Emission([_Batching(looks, fail_part=1)], _Plain(looks))
    emission.emit(_requests(3 * LOOK_EVERY))
    recorded = [entry[1] for entry in looks if isinstance(entry, tuple) and entry[0] == "recorded"]
    assert recorded == [tuple(range(LOOK_EVERY)), tuple(range(2 * LOOK_EVERY, 3 * LOOK_EVERY))]
    assert emission.failed == LOOK_EVERY
