"""Hostile strings as telemetry values: a lone surrogate, control characters, 10 KB names, thousands of them.

Through a real ``llmtap serve`` and a real upstream: ``/metrics`` keeps answering, OTLP exports, records
and the live view keep every request, each label is a clean and short string, junk neither grows the
page without end nor keeps a real model's label out; and the label guard's own rules, on a fake clock.
"""

from __future__ import annotations

import json
import random
import string
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap.config.load import build
from llmtap.config.types import ConfigError
from llmtap.labels import LABEL_CAP, OTHER, LabelGuard, clean
from llmtap.telemetry import semconv as sc
from tests.conftest import PATIENCE
from tests.e2e.test_otlp import HTTPReceiver, attributes
from tests.support.net import LoopbackHTTPServer
from tests.support.procs import Llmtap, metric_value
from tests.support.records import plain
from tests.telemetry.test_live import sse

#: What a lone surrogate and a NUL or an escape character become on a label.
SURROGATE_MODEL, SURROGATE_LABEL = "\udc80-x", "\ufffd-x"
CONTROL_MODEL, CONTROL_LABEL = "ctl\x00\x1b[31m", "ctl\ufffd\ufffd[31m"


class _Echo(BaseHTTPRequestHandler):
    """An OpenAI-compatible upstream that names the request's own model as the one that answered (and in its
    id); a body with ``fail_with`` gets a 400 whose error type is that string."""

    protocol_version = "HTTP/1.1"
    # Headers and body go in two writes: without this, each kept-alive request waits out a delayed ACK.
    disable_nagle_algorithm = True

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        model = body.get("model", "")
        if "fail_with" in body:
            status = 400
            reply: dict[str, Any] = {"error": {"type": body["fail_with"], "message": body["fail_with"] + " refused"}}
        else:
            status = 200
            reply = {
                "id": f"chatcmpl-{model}",
                "object": "chat.completion",
                "created": 1700000000,
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        # ensure_ascii: a lone surrogate goes back as the escape it came in as, which any JSON parser reads.
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@pytest.fixture(scope="module")
def echo() -> Iterator[str]:
    server = LoopbackHTTPServer(_Echo)
    yield server.url
    server.close()


def chat(model: str, **extra: Any) -> bytes:
    """A chat request body; ``json.dumps`` writes a lone surrogate as the JSON escape ``\\udc80``."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    return json.dumps(body).encode()


def send(client: httpx.Client, proxy: Llmtap, body: bytes) -> int:
    answer = client.post(proxy.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    return answer.status_code


def scrape(proxy: Llmtap) -> httpx.Response:
    answer = httpx.get(proxy.admin_url + "/metrics", timeout=120)
    assert answer.status_code == 200, answer.text[:500]
    return answer


#: The reasons a tape is lost in whole (``llmtap.telemetry.intake.relays.TAPE_DROP_REASONS``): not a request recorded.
WHOLE_TAPE_LOST = ("channel_full", "queue_full", "evicted")


def lost(text: str) -> float:
    """Tapes lost in whole, by every reason, on a ``/metrics`` page."""
    dropped = "llmtap_telemetry_tapes_dropped_total"
    return sum(metric_value(text, dropped, llmtap_telemetry_reason=reason) for reason in WHOLE_TAPE_LOST)


def recorded(proxy: Llmtap, count: int, timeout: float = 120.0) -> str:
    """``/metrics`` once the telemetry process has taken ``count`` requests: recorded, or lost and counted (a
    telemetry process that falls behind on a busy machine drops tapes rather than hold up the relay)."""
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(proxy).text
        done, dropped = metric_value(text, "llmtap_requests_total"), lost(text)
        if done + dropped >= count:
            return text
        assert time.monotonic() < deadline, f"recorded {done} and lost {dropped} of {count} requests"
        time.sleep(0.2)


def label_values(text: str, label: str) -> set[str]:
    """Every value ``label`` takes on a Prometheus page (values are written escaped; none here needs it)."""
    values = set()
    marker = f'{label}="'
    for line in text.split("\n"):
        at = line.find(marker)
        if at >= 0 and not line.startswith("#"):
            start = at + len(marker)
            values.add(line[start : line.index('"', start)])
    return values


# --- one lone surrogate, everywhere it goes ------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(echo: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Llmtap, HTTPReceiver, Path]]:
    """llmtap exporting spans and metrics over OTLP/HTTP and writing records, in front of the echo upstream."""
    receiver = HTTPReceiver()
    folder = tmp_path_factory.mktemp("labels")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_METRIC_EXPORT_INTERVAL": "200",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    records = folder / "records"
    proxy = Llmtap(echo, folder / "llmtap.log", "--record", str(records), env=env)
    yield proxy, receiver, records
    proxy.close()
    receiver.close()


def test_a_lone_surrogate_or_a_nul_becomes_a_replacement_character_everywhere(
    exported: tuple[Llmtap, HTTPReceiver, Path],
) -> None:
    proxy, receiver, records = exported
    with httpx.Client(timeout=30) as client:
        assert send(client, proxy, chat(SURROGATE_MODEL, stop=["\udc80"])) == 200
        assert send(client, proxy, chat(CONTROL_MODEL)) == 200
        assert send(client, proxy, chat("plain", fail_with="\udc80bad")) == 400
    text = recorded(proxy, 3)
    # Not once: every scrape after them answers.
    text = scrape(proxy).text
    assert {SURROGATE_LABEL, CONTROL_LABEL} <= label_values(text, "gen_ai_request_model")
    assert {SURROGATE_LABEL, CONTROL_LABEL} <= label_values(text, "gen_ai_response_model")
    assert "\ufffdbad" in label_values(text, "error_type")

    # OTLP: the spans of all three arrive (one bad string would fail their whole batch), cleaned.
    deadline = time.monotonic() + PATIENCE
    while True:
        roots = {s.name: s for _, s in receiver.received.spans() if s.name.startswith("chat ")}
        if len(roots) >= 3:
            break
        assert time.monotonic() < deadline, sorted(roots)
        time.sleep(0.05)
    root = attributes(roots[f"chat {SURROGATE_LABEL}"].attributes)
    assert root[sc.REQUEST_MODEL] == root[sc.RESPONSE_MODEL] == SURROGATE_LABEL
    assert root[sc.RESPONSE_ID] == f"chatcmpl-{SURROGATE_LABEL}"
    assert root[sc.REQUEST_STOP_SEQUENCES] == ["\ufffd"]
    # On a span only what is not UTF-8 goes: a NUL is a valid character there.
    assert attributes(roots["chat " + CONTROL_LABEL].attributes)[sc.REQUEST_MODEL] == CONTROL_MODEL
    failed = roots["chat plain"]
    assert attributes(failed.attributes)[sc.ERROR_TYPE] == "\ufffdbad"
    assert failed.status.message == "\ufffdbad refused"
    # OTLP metrics: the export goes through, with the replaced label.
    deadline = time.monotonic() + PATIENCE
    while True:
        metric = receiver.received.latest_metrics().get(sc.RELEASED.operation_duration)
        models = (
            {attributes(p.attributes).get(sc.REQUEST_MODEL) for p in metric[1].histogram.data_points}
            if metric
            else set()
        )
        if SURROGATE_LABEL in models:
            break
        assert time.monotonic() < deadline, models
        time.sleep(0.05)

    # The record file keeps every line, and every line is UTF-8.
    raw = plain(records)
    lines = [json.loads(line) for line in raw.decode("utf-8").splitlines()]
    assert [r["model"] for r in lines] == [SURROGATE_LABEL, CONTROL_MODEL, "plain"]
    assert lines[2]["error_type"] == "\ufffdbad"

    # The live view has them under the labels /metrics gives them.
    with httpx.stream("GET", proxy.admin_url + "/events?window=all", timeout=20) as r:
        for kind, data, _ in sse(r.iter_lines()):
            if kind == "snapshot":
                series = {s["model"] for s in json.loads(data)["series"]}
                break
    assert {SURROGATE_LABEL, CONTROL_LABEL} <= series


# --- thousands of junk names ---------------------------------------------------------------------------

JUNK = 2000
JUNK_BYTES = 10 * 1024
#: The page after the junk: the real and pinned models' series, and those of the few junk names that got a
#: label at their first use (``trial``: 8), each with names cut to 256 characters: measured 5.3 MB. Before
#: the bound, the first 64 junk names kept their 10 KB as labels: over 1 GB.
PAGE_BOUND = 12 << 20


def test_junk_model_names_neither_keep_a_real_model_out_nor_grow_metrics(echo: str, tmp_path: Path) -> None:
    proxy = Llmtap(echo, tmp_path / "llmtap.log", env={"LLMTAP_METRIC_MODELS": "pinned-model"})
    try:
        rng = random.Random(7)
        alphabet = string.ascii_letters + string.digits
        started = time.monotonic()
        with httpx.Client(timeout=30) as client:
            for _ in range(JUNK):
                junk = "".join(rng.choices(alphabet, k=JUNK_BYTES))
                assert send(client, proxy, chat(junk)) == 200
            sent = time.monotonic() - started
            # The junk's tapes (20 KB each) may outrun a telemetry process on a busy machine: some are then lost,
            # and counted. The real and pinned models' four go in once that backlog is gone, so none is lost.
            backlog = recorded(proxy, JUNK)
            for _ in range(3):
                assert send(client, proxy, chat("real-model")) == 200
            assert send(client, proxy, chat("pinned-model")) == 200
        recorded(proxy, JUNK + 4)
        started = time.monotonic()
        page = scrape(proxy)
        took = time.monotonic() - started
        text = page.text
        print(
            f"\n{JUNK} junk names of {JUNK_BYTES} B sent in {sent:.1f} s ({lost(backlog):.0f} tapes lost); /metrics "
            f"{len(page.content):,} B in {took:.2f} s, {len(label_values(text, 'gen_ai_request_model'))} model labels"
        )
        assert lost(text) == lost(backlog)
        requests = "llmtap_requests_total"
        # A real model sent a few times gets its label: at its second use, the first reading _OTHER.
        assert metric_value(text, requests, gen_ai_request_model="real-model") >= 2
        # A model the settings name keeps its label from its first request, whatever came before.
        assert metric_value(text, requests, gen_ai_request_model="pinned-model") == 1
        assert len(page.content) < PAGE_BOUND
        models = label_values(text, "gen_ai_request_model") | label_values(text, "gen_ai_response_model")
        assert max(len(m) for m in models) <= LABEL_CAP
        # Junk seen once gets a label only while the first few names do (trial), never the rest.
        assert len(models - {"real-model", "pinned-model", OTHER}) <= 8
    finally:
        proxy.close()


def test_a_frequent_new_model_takes_the_slot_of_the_weakest_and_the_eviction_is_counted(
    echo: str, tmp_path: Path
) -> None:
    proxy = Llmtap(echo, tmp_path / "llmtap.log")
    try:
        with httpx.Client(timeout=30) as client:
            # All 64 slots taken, each name used twice.
            for i in range(64):
                for _ in range(2):
                    assert send(client, proxy, chat(f"model-{i:02d}")) == 200
            for _ in range(5):
                assert send(client, proxy, chat("newcomer")) == 200
        text = recorded(proxy, 64 * 2 + 5)
        evicted = "llmtap_telemetry_labels_evicted_total"
        assert metric_value(text, evicted, llmtap_telemetry_attribute=sc.REQUEST_MODEL) == 1
        assert metric_value(text, "llmtap_requests_total", gen_ai_request_model="newcomer") >= 2
        # The oldest of the equally used names was the weakest; it keeps its series (the SDK forgets none).
        assert metric_value(text, "llmtap_requests_total", gen_ai_request_model="model-00") == 2
        assert len(label_values(text, "gen_ai_request_model") - {OTHER}) == 65
    finally:
        proxy.close()


def test_an_upstreams_error_types_are_bounded_like_models(echo: str, tmp_path: Path) -> None:
    proxy = Llmtap(echo, tmp_path / "llmtap.log")
    try:
        with httpx.Client(timeout=30) as client:
            for i in range(300):
                assert send(client, proxy, chat("real-model", fail_with=f"error-{i}")) == 400
            for _ in range(3):
                assert send(client, proxy, chat("real-model", fail_with="rate_limited")) == 400
        text = recorded(proxy, 303)
        types = label_values(text, "error_type")
        assert "rate_limited" in types
        assert len(types - {OTHER}) <= 32, len(types)
    finally:
        proxy.close()


# --- the rules, on a fake clock ------------------------------------------------------------------------


def test_clean_replaces_what_is_not_utf8_and_cuts_long_values() -> None:
    assert clean("\udc80-x") == "\ufffd-x"
    assert clean("a\nb\x00") == "a\nb\x00"  # valid on a span
    assert clean("a\nb\x00\u2028", label=True) == "a\ufffdb\ufffd\ufffd"
    long = clean("m" * 10_000, LABEL_CAP, label=True)
    assert len(long) == LABEL_CAP and long.endswith("\u2026")
    assert clean("gpt-4o", label=True) == "gpt-4o"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def guard(clock: Clock, **kwargs: Any) -> LabelGuard:
    options: dict[str, Any] = {"trial": 1, "candidates": 4, "replacements": 2, **kwargs}
    return LabelGuard("m", 2, clock=clock, **options)


def test_first_uses_past_the_trial_wait_for_a_second() -> None:
    clock = Clock()
    g = guard(clock)
    assert [g("a"), g("b"), g("b")] == ["a", OTHER, "b"]
    assert g.label("b") == "b" and g.label("c") == OTHER


def test_a_stale_value_loses_its_slot_to_a_frequent_one_and_may_come_back_for_free() -> None:
    clock = Clock()
    evicted: list[str] = []
    g = guard(clock, replacements=1, on_evict=evicted.append)
    for _ in range(5):
        g("a"), g("b"), g("b")
    assert [g("c"), g("c")] == [OTHER, OTHER]  # "a" and "b" are used far more
    clock.now = 8 * 3600.0  # hours later, nobody sends "a" or "b" any more: a use of "c" now outweighs them
    assert [g("c"), g("c")] == [OTHER, "c"]
    assert evicted == ["a"] and g.evicted == 1 and g.label("a") == OTHER
    # The budget of new values is spent; "a" had a label before, so it comes back without a token.
    for _ in range(3):
        g("d")
    assert g.label("d") == OTHER
    assert [g("a"), g("a")] == [OTHER, "a"]
    assert evicted == ["a", "b"]
    # The budget refills over a day (and by then "d", used more lately than "c", outweighs it at once).
    clock.now += LabelGuard.DAY
    assert g("d") == "d" and evicted == ["a", "b", "c"]


def test_pinned_values_keep_their_label_and_take_no_slot() -> None:
    clock = Clock()
    g = guard(clock, pinned=("p",))
    assert [g("a"), g("b"), g("b"), g("p")] == ["a", OTHER, "b", "p"]
    assert g.label("p") == "p" and g.label("a") == "a"


def test_candidates_are_bounded_and_the_weakest_is_forgotten_first() -> None:
    clock = Clock()
    g = guard(clock, trial=0, candidates=4)
    for name in ("x", "x", "y", "y"):
        g(name)
    g("real"), g("real")  # twice: not enough to beat "x" or "y", but stronger than any name seen once
    for i in range(100):
        clock.now += 1.0
        assert g(f"junk{i}") == OTHER
    assert len(g._waiting) == 4 and "real" in g._waiting
    assert "junk0" not in g._waiting


@pytest.mark.parametrize(
    ("value", "needle"),
    [("a,b\x01", "control"), (",".join(f"m{i}" for i in range(300)), "at most 256"), ("x" * 300, "256 characters")],
)
def test_metric_models_setting_refuses_bad_names(value: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build({"upstream": "http://127.0.0.1:1"}, env={"LLMTAP_METRIC_MODELS": value})


def test_metric_models_setting_from_the_variable_and_the_file(tmp_path: Path) -> None:
    env = {"LLMTAP_METRIC_MODELS": " gpt-4o , llama-3 ,gpt-4o"}
    assert build({"upstream": "http://127.0.0.1:1"}, env=env).telemetry.metric_models == ("gpt-4o", "llama-3")
    config = tmp_path / "llmtap.yaml"
    config.write_text("upstream: http://127.0.0.1:1\ntelemetry: {metric_models: [gpt-4o, o3]}\n")
    assert build({"config": str(config)}, env={}).telemetry.metric_models == ("gpt-4o", "o3")
