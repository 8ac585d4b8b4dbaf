"""The live view in a real browser (Debian's Chromium, driven by Playwright) while simulator traffic flows.

The figures read from the page's DOM must equal what ``/metrics`` counts, and its percentiles the exact ones
over the requests' own values, within the page's rounding; in ``llmtap demo --serve`` the page must agree with
the demo's tables on the same requests, one card per prompt layout; a new request's waterfall must appear
within two seconds, and the page must ask nothing of any host but the
admin listener. Screenshots are saved for people to look at, under ``LLMTAP_ARTIFACTS`` when it is set (CI
keeps that directory), and one is taken by Chromium's own one-shot mode on load: the page must already show
its figures then, and must let the screenshot finish (the event stream opens after the load).
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmtap import simulator
from llmtap.analysis.finish import Finished
from llmtap.analysis.stats import quantile
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.commands import demo
from llmtap.config.types import SLO, Route, Settings
from llmtap.relay.app import ProxyApp
from llmtap.serve.local import in_process
from llmtap.telemetry import semconv as sc
from llmtap.telemetry.admin.server import AdminApp
from llmtap.telemetry.exposition.prometheus import PrometheusReader
from tests.conftest import PATIENCE, ServerThread, require_real
from tests.support.procs import ROOT
from tests.telemetry.test_live import HISTOGRAMS, initial, prom_buckets, prom_sum

pytestmark = [pytest.mark.real, pytest.mark.e2e]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As root and offline: no sandbox, and none of Chromium's own calls home (they fail here, many at a time).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
]
#: Requests in the first test: enough to keep traffic flowing for a few seconds, fewer than the page keeps.
TRAFFIC = 90
FIXED = "You complete code for a Python service. Answer with code only. " * 12


class Gate:
    """Around the recorder's emission: when shut, it holds the recorder's worker once one more batch of finished
    requests has gone to every emitter.

    The emitters take a batch one after another (the metrics all of it, then the listeners all of it), so only
    between batches do ``/metrics`` and the live window cover exactly the same requests. While it holds they do,
    however many more finish meanwhile (they wait in the recorder's queue): the page can be compared with
    ``/metrics`` while traffic keeps flowing.
    """

    def __init__(self) -> None:
        self.shut = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()

    def around(self, emit: Callable[[list[Finished]], None]) -> Callable[[list[Finished]], None]:
        """``emit``, then the hold when the gate is shut."""

        def emit_then_hold(requests: list[Finished]) -> None:
            emit(requests)
            if self.shut.is_set():
                self.holding.set()
                self.release.wait(20)

        return emit_then_hold

    def close(self, flowing: Callable[[], bool]) -> None:
        """Shut the gate and wait until it holds a request, while ``flowing`` says requests still come; else open it
        again and fail (the page cannot be compared while traffic flows if none does)."""
        self.release.clear()
        self.shut.set()
        deadline = time.monotonic() + PATIENCE
        while not self.holding.wait(0.05):
            if not flowing() or time.monotonic() > deadline:
                self.open()
                raise AssertionError("no request was recorded while the gate was shut")

    def open(self) -> None:
        self.shut.clear()
        self.holding.clear()
        self.release.set()


@dataclass
class Stack:
    """Two simulated servers, the proxy in front, its admin listener, and in-memory spans."""

    proxy: ProxyApp
    proxy_url: str
    admin_url: str
    spans: InMemorySpanExporter
    gate: Gate
    summaries: list[tuple[Timeline, Summary]] = field(default_factory=list)

    def traffic(
        self, n: int, concurrency: int = 4, *, ahead: int = 0, go: threading.Event | None = None
    ) -> threading.Thread:
        """Start ``n`` requests in the background: streams, unary calls, errors and cancellations. With ``go``, the
        first ``ahead`` go at once and the rest once ``go`` is set."""

        def one(i: int) -> None:
            if go is not None and i >= ahead:
                assert go.wait(PATIENCE), "the traffic was never let go"
            route, tokens = ("code", 24) if i % 2 else ("fast", 12)
            body: dict[str, Any] = {
                "model": "missing-model" if i % 9 == 4 else "llmtap-sim",
                "stream": i % 10 != 3,
                "max_tokens": tokens,
                "messages": [{"role": "system", "content": FIXED}, {"role": "user", "content": f"task {i}"}],
            }
            url = f"{self.proxy_url}/{route}/v1/chat/completions"
            with httpx.stream("POST", url, json=body, timeout=30) as r:
                for k, _ in enumerate(r.iter_raw()):
                    if i % 13 == 6 and k == 1:
                        break  # the client leaves mid-stream: a cancellation

        def run() -> None:
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(one, range(n)))

        thread = threading.Thread(target=run, name="traffic")
        thread.start()
        return thread


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    code = simulator.run_in_thread(simulator.get_profile("code", decode_s_per_token=0.006))
    fast = simulator.run_in_thread(simulator.get_profile("fast"))
    routes = (
        Route(prefix="/code", upstream=code.url, name="code", provider="vllm", strip_prefix=True),
        Route(prefix="/fast", upstream=fast.url, name="fast", provider="vllm", strip_prefix=True),
    )
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    prometheus = PrometheusReader()
    meter_provider = MeterProvider(metric_readers=[prometheus])
    settings = Settings(routes=routes, slo=SLO(ttft=0.04, tpot=0.0065), log_level="warning")
    local = in_process(settings, tracer_provider=tracer_provider, meter_provider=meter_provider)
    app = local.app
    admin = AdminApp(local, prometheus, traces=True)  # spans go to a backend (in memory): show trace ids
    gate = Gate()
    out = Stack(app, "", "", spans, gate)
    local.recorder.listeners.append(lambda tl, s: out.summaries.append((tl, s)))
    emission = local.recorder.emission
    emission.emit = gate.around(emission.emit)  # type: ignore[method-assign,assignment]
    with ServerThread(app) as proxy_server, ServerThread(admin) as admin_server:
        out.proxy_url, out.admin_url = proxy_server.url, admin_server.url
        yield out
        gate.open()
        admin.live.close()
    code.stop()
    fast.stop()
    tracer_provider.shutdown()
    meter_provider.shutdown()


@dataclass
class Browser:
    """One headless Chromium page, with every request it makes written down (and any to another host refused)."""

    page: Any
    requests: list[str]
    refused: list[str]


@pytest.fixture(scope="module")
def browser(stack: Stack) -> Iterator[Browser]:
    require_real(importlib.util.find_spec("playwright") is not None, "Playwright", "pip install -e '.[test]'")
    require_real(Path(CHROMIUM).exists(), "Chromium", "bash .ci/install.d/40-chromium.sh")
    from playwright.sync_api import sync_playwright

    admin = urlsplit(stack.admin_url).netloc
    requests: list[str] = []
    refused: list[str] = []

    def guard(route: Any) -> None:
        url = route.request.url
        if urlsplit(url).netloc == admin:
            route.continue_()
        else:
            refused.append(url)
            route.abort()

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = chromium.new_context(viewport={"width": 1440, "height": 1000}, device_scale_factor=1)
        context.route("**/*", guard)
        page = context.new_page()
        page.on("request", lambda r: requests.append(r.url))
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        yield Browser(page, requests, refused)
        context.close()
        chromium.close()
    assert errors == [], errors


# --- reading the page ---------------------------------------------------------------------------

_READ = """() => ({
  last: Number(document.getElementById('series').dataset.last),
  seconds: Number(document.getElementById('series').dataset.seconds),
  cards: [...document.querySelectorAll('.card')].map(c => ({
    route: c.dataset.route,
    model: c.dataset.model,
    version: c.dataset.version || null,
    figs: Object.fromEntries([...c.querySelectorAll('[data-fig]')].map(n => [n.dataset.fig, n.textContent])),
    notes: Object.fromEntries([...c.querySelectorAll('.tile .value')].map(
      n => [n.dataset.fig, n.nextElementSibling.textContent])),
  })),
  rows: [...document.querySelectorAll('#requests .req')].map(r => ({
    id: Number(r.dataset.id), error: r.querySelector('.badge.err') !== null })),
})"""


def shown(text: str) -> tuple[float, float]:
    """A figure as the page shows it, and half a unit of its last digit (what rounding may have moved)."""
    text = text.strip().replace(",", "")
    scale = {"ms": 1e-3, "s": 1.0, "%": 1e-2}
    match = re.fullmatch(r"(-?\d+(?:\.(\d+))?)\s*(ms|s|%)?", text)
    assert match is not None, text
    decimals = len(match.group(2) or "")
    factor = scale.get(match.group(3) or "", 1.0)
    return float(match.group(1)) * factor, 0.5 * 10**-decimals * factor * (1 + 1e-9)


def near(text: str, expected: float | None, what: str) -> None:
    if expected is None or (isinstance(expected, float) and math.isnan(expected)):
        assert text == "–", (what, text)
        return
    value, tolerance = shown(text)
    assert abs(value - expected) <= tolerance, f"{what}: page {text!r}, /metrics {expected!r}"


def count(text: str) -> int:
    return int(text.split()[0].replace(",", ""))


def values_of(summaries: list[tuple[Timeline, Summary]], route: str, model: str) -> dict[str, list[float]]:
    """One card's latency values from the requests' own summaries, each under its ``llmtap.*`` histogram's
    condition: TTFT, ITL, TTFOT and TTST of streams, TPOT of successful requests (the model: the request's, else
    the response's)."""
    mine = []
    for tl, s in summaries:
        named = tl.request.model if tl.request is not None and tl.request.model else tl.response_model
        if tl.route == route and (named or "") == model:
            mine.append((tl, s))
    streams = [s for tl, s in mine if tl.request is not None and tl.request.stream and s.ttft is not None]
    return {
        "ttft": [s.ttft for s in streams if s.ttft is not None],
        "itl": [x for s in streams for x in s.itl_per_token],
        "tpot": [s.tpot for tl, s in mine if tl.outcome == "ok" and s.tpot is not None],
        "ttfot": [s.ttfot for s in streams if s.ttfot is not None],
        "ttst": [s.ttst for s in streams if s.ttst is not None],
    }


def compare(stack: Stack, view: dict[str, Any]) -> int:
    """Every figure on the page against ``/metrics``, and its percentiles against the exact ones over the
    requests' own values; returns how many requests the page covered."""
    text = httpx.get(stack.admin_url + "/metrics").text
    seconds = view["seconds"]
    total = 0
    assert view["cards"], "no figures on the page"
    for card in view["cards"]:
        key = (card["route"], card["model"])
        figs, notes = card["figs"], card["notes"]
        requests = prom_sum(text, "llmtap_requests_total", *key)
        met = prom_sum(text, "llmtap_requests_total", *key, llmtap_slo="met")
        output = prom_sum(text, "llmtap_usage_output_tokens_total", *key)
        inputs = prom_sum(text, "llmtap_usage_input_tokens_total", *key)
        cached = prom_sum(text, "llmtap_usage_cache_read_input_tokens_total", *key)
        assert count(figs["requests"]) == requests, key
        assert count(figs["errors"]) == prom_sum(text, "llmtap_requests_total", *key, llmtap_outcome="error"), key
        assert count(notes["errors"]) == prom_sum(text, "llmtap_requests_total", *key, llmtap_outcome="cancelled")
        assert count(notes["output_tokens_per_s"]) == output, key
        assert [count(x) for x in notes["cached_share"].split("/")] == [cached, inputs], key
        near(figs["requests_per_s"], requests / seconds, f"{key} requests/s")
        near(figs["output_tokens_per_s"], output / seconds, f"{key} output tokens/s")
        near(figs["goodput_per_s"], met / seconds, f"{key} goodput/s")
        near(figs["cached_share"], cached / inputs if inputs else None, f"{key} cached share")
        values = values_of(stack.summaries[: view["last"]], *key)
        for fig, name in HISTOGRAMS.items():
            series = prom_buckets(text, name, *key)
            n = series[-1][1] if series else 0
            assert count(figs[f"{fig}.count"]) == n == len(values[fig]), (key, fig)
            for q in (0.5, 0.95, 0.99):
                near(figs[f"{fig}.p{round(q * 100)}"], quantile(values[fig], q), f"{key} {fig} p{round(q * 100)}")
        total += int(requests)
    return total


def wait_until(page: Any, predicate: str, timeout: float = PATIENCE) -> None:
    """Poll a JavaScript function until it returns true (the page's CSP forbids the eval of ``wait_for_function``)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(predicate):
        assert time.monotonic() < deadline, f"timed out waiting for {predicate}"
        page.wait_for_timeout(25)


def wait_for_snapshot(page: Any, last: int) -> dict[str, Any]:
    """The page's figures once a snapshot covering request ``last`` has arrived."""
    wait_until(page, f"() => Number(document.getElementById('series').dataset.last) === {last}")
    view: dict[str, Any] = page.evaluate(_READ)
    assert view["last"] == last
    return view


def recorded(stack: Stack) -> int:
    """How many requests the live window has taken in (the id of the last one)."""
    return len(stack.summaries)


def artifacts(tmp_path: Path) -> Path:
    """Where pictures for people go: ``LLMTAP_ARTIFACTS`` (kept by CI), else the test's own directory."""
    out = Path(os.environ.get("LLMTAP_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


# --- the tests ----------------------------------------------------------------------------------


def test_figures_equal_metrics_while_traffic_flows(stack: Stack, browser: Browser) -> None:
    page = browser.page
    page.goto(stack.admin_url + "/?window=all")
    # A few requests first, the rest once the page shows them: a slow page load cannot outlast the traffic.
    go = threading.Event()
    traffic = stack.traffic(TRAFFIC, concurrency=3, ahead=6, go=go)
    page.wait_for_selector(".card", timeout=10_000)
    go.set()
    compared = []
    for _ in range(2):
        time.sleep(0.5)
        stack.gate.close(traffic.is_alive)
        try:
            view = wait_for_snapshot(page, recorded(stack))
            compared.append(compare(stack, view))
        finally:
            stack.gate.open()
    traffic.join(60)
    assert stack.proxy.flush(10)
    view = wait_for_snapshot(page, recorded(stack))
    final = compare(stack, view)
    assert compared[0] < compared[1] < final == recorded(stack) == TRAFFIC

    # The waterfalls agree with the figures: one row per request, errors and cancellations marked.
    rows = view["rows"]
    assert sorted(r["id"] for r in rows) == list(range(1, TRAFFIC + 1))
    failed = sum(1 for tl, _ in stack.summaries if tl.outcome != "ok")
    assert sum(r["error"] for r in rows) == failed > 0

    # No percentile lies past the largest value it rests on.
    for card in view["cards"]:
        ttfts = values_of(stack.summaries, card["route"], card["model"])["ttft"]
        if ttfts:
            value, tolerance = shown(card["figs"]["ttft.p99"])
            assert value <= max(ttfts) + tolerance, (card["route"], value, max(ttfts))


def test_new_waterfall_within_two_seconds(stack: Stack, browser: Browser, tmp_path: Path) -> None:
    page = browser.page
    page.goto(stack.admin_url + "/?window=5m")
    page.wait_for_selector(".card", timeout=10_000)
    traffic = stack.traffic(16, concurrency=2)
    body = {
        "model": "llmtap-sim",
        "stream": True,
        "max_tokens": 40,
        "messages": [{"role": "system", "content": FIXED}, {"role": "user", "content": "the one to find"}],
    }
    with httpx.stream("POST", f"{stack.proxy_url}/code/v1/chat/completions", json=body, timeout=30) as r:
        raw = b"".join(r.iter_raw())
    done = time.monotonic()
    match = re.search(rb'"id":\s*"([^"]+)"', raw)
    assert match is not None
    rid = match.group(1).decode()
    row = page.wait_for_selector(f'.req[data-response-id="{rid}"]', timeout=2000)
    elapsed = time.monotonic() - done
    assert elapsed < 2.0
    print(f"\nwaterfall of {rid} shown {elapsed * 1000:.0f} ms after its stream ended")

    # Its ticks: one per content chunk; its details: the trace id of its root span.
    assert row is not None
    ticks = row.eval_on_selector("path.ticks", "p => (p.getAttribute('d').match(/M/g) || []).length")
    tl = next(tl for tl, _ in stack.summaries if tl.response_id == rid)
    assert ticks == len(tl.chunk_times) > 1
    row.click()
    details = page.wait_for_selector("#details:not([hidden])", timeout=2000)
    assert details is not None
    text = details.inner_text()
    (root,) = [x for x in stack.spans.get_finished_spans() if (x.attributes or {}).get(sc.RESPONSE_ID) == rid]
    assert root.context is not None
    assert format(root.context.trace_id, "032x") == tl.trace_id
    assert tl.trace_id is not None and tl.trace_id in text.replace("\n", "")
    assert "the one to find" not in page.content()
    traffic.join(60)
    page.wait_for_timeout(1200)  # a settled snapshot for the picture
    # A verdict that waits says why, as `llmtap slo` does: p99 needs 100 requests, and no card has them yet.
    lines = page.eval_on_selector_all(".slo-line", "ns => ns.map(n => n.textContent)")
    waiting = [line for line in lines if "insufficient" in line]
    assert waiting, lines
    for line in waiting:
        assert re.search(r"insufficient \(\d+ of 100 requests\)", line), line
    shot = artifacts(tmp_path) / "live-view.png"
    page.evaluate("window.scrollTo(0, 0)")  # the sticky header at the top, not across a card
    page.wait_for_timeout(200)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    if os.environ.get("LLMTAP_UPDATE_SCREENSHOT"):
        # The README's picture, taken again by this test when asked (not on every run: it would change the tree).
        shutil.copyfile(shot, ROOT / "docs" / "live-view.png")
    print(f"screenshot: {shot}")


def test_card_subtitles_are_shown_whole(stack: Stack, browser: Browser) -> None:
    stack.traffic(6, concurrency=2).join(60)
    assert stack.proxy.flush(10)
    page = browser.page
    # Two columns of cards at their narrowest: the tiles' subtitles ("720 / 960 tok") are longest against them.
    page.set_viewport_size({"width": 1160, "height": 1000})
    try:
        page.goto(stack.admin_url + "/?window=all")
        page.wait_for_selector(".card")
        cut = page.evaluate(
            """() => [...document.querySelectorAll('.tile small')]
                .filter(n => n.scrollWidth > n.clientWidth + 1)
                .map(n => n.textContent)"""
        )
        notes = page.evaluate("() => [...document.querySelectorAll('.tile small')].map(n => n.textContent)")
        assert notes and any("/" in n for n in notes), notes
        assert cut == [], f"subtitles cut off: {cut}"
    finally:
        page.set_viewport_size({"width": 1440, "height": 1000})


def test_only_the_admin_listener_is_asked(stack: Stack, browser: Browser) -> None:
    page = browser.page
    page.goto(stack.admin_url + "/")
    page.wait_for_selector(".req", timeout=10_000)
    for name in ("1m", "15m", "all", "5m"):
        page.click(f'#windows button[data-window="{name}"]')
        wait_until(page, f"() => document.getElementById('series').dataset.window === '{name}'")
    page.click('#scale button[data-scale="each"]')
    page.click("#requests .req")
    page.wait_for_selector("#details:not([hidden])")
    admin = urlsplit(stack.admin_url).netloc
    assert browser.requests, "the page made no request at all"
    outside = [u for u in browser.requests if urlsplit(u).scheme != "data" and urlsplit(u).netloc != admin]
    assert outside == [] and browser.refused == []
    paths = {urlsplit(u).path for u in browser.requests}
    assert paths <= {"/", "/live.js", "/live.css", "/events"}, paths


def headless(flag: str, url: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Chromium's own one-shot mode: load ``url``, then screenshot or dump the DOM once it has loaded."""
    args = [CHROMIUM, "--headless", *CHROMIUM_ARGS, "--hide-scrollbars", "--window-size=1440,1000", flag, url]
    # A page that kept its load waiting (an open stream before load) would hang here: the bound says so.
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=90, check=False)


def test_first_figures_are_in_the_page_on_load(stack: Stack, tmp_path: Path) -> None:
    require_real(Path(CHROMIUM).exists(), "Chromium", "bash .ci/install.d/40-chromium.sh")
    traffic = stack.traffic(12, concurrency=2)
    traffic.join(60)
    assert stack.proxy.flush(10)
    n = recorded(stack)
    url = stack.admin_url + "/?window=all"
    snapshot = httpx.get(url).text
    # The page itself carries the figures: no stream needed to read them.
    assert f'"last":{n}' in snapshot

    dom = headless("--dump-dom", url, tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    cards = re.findall(r'<b data-fig="requests">([\d,]+)</b>', page)
    assert cards and sum(int(c.replace(",", "")) for c in cards) == n, cards
    ttft = re.findall(r'<td data-fig="ttft\.p50"[^>]*>([^<]+)</td>', page)
    # A card of failed requests only has no TTFT; the others have theirs.
    assert any(re.fullmatch(r"[\d.]+ (ms|s)", t) for t in ttft), ttft
    assert f'data-last="{n}"' in page
    assert 'class="req' in page  # the waterfalls too

    out = artifacts(tmp_path)
    shot = out / "live-view-on-load.png"
    taken = headless(f"--screenshot={shot}", url, tmp_path)
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"screenshot on load: {shot}")


def test_demo_page_agrees_with_its_tables(tmp_path: Path) -> None:
    """``llmtap demo --serve``: each table row (workload and prompt layout) is one card, with the same figures."""
    require_real(importlib.util.find_spec("playwright") is not None, "Playwright", "pip install -e '.[test]'")
    require_real(Path(CHROMIUM).exists(), "Chromium", "bash .ci/install.d/40-chromium.sh")
    from playwright.sync_api import sync_playwright

    workloads = demo.default_workloads(requests=4, concurrency=4)
    ready, stop = threading.Event(), threading.Event()
    found: dict[str, Any] = {}

    async def serve(run: demo.DemoRun, view: str, proxy_url: str) -> None:
        found["run"], found["view"] = run, view
        ready.set()
        await asyncio.to_thread(stop.wait, 600)

    def run_demo() -> None:
        try:
            asyncio.run(demo.run(workloads, env={}, telemetry_dir=tmp_path / "telemetry", serve=serve))
        except BaseException as e:  # handed to the test's thread
            found["error"] = e
            ready.set()

    thread = threading.Thread(target=run_demo, name="demo")
    thread.start()
    try:
        assert ready.wait(300), "the demo never served its live view"
        assert "error" not in found, found.get("error")
        run: demo.DemoRun = found["run"]
        first = initial(httpx.get(found["view"]).text)

        def read_page() -> dict[str, Any]:
            # A thread of its own: the module's browser may hold this thread's Playwright loop.
            with sync_playwright() as p:
                chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                try:
                    page = chromium.new_page(viewport={"width": 1440, "height": 1000})
                    page.goto(found["view"])
                    page.wait_for_selector(".card", timeout=10_000)
                    shown_view = wait_for_snapshot(page, first["snapshot"]["last"])
                    page.screenshot(path=str(artifacts(tmp_path) / "live-view-demo.png"), full_page=True)
                    return shown_view
                finally:
                    chromium.close()

        with ThreadPoolExecutor(1) as pool:
            view = pool.submit(read_page).result(timeout=120)
    finally:
        stop.set()
        thread.join(120)
    assert not thread.is_alive()
    assert "error" not in found, found.get("error")

    snapshot = {(s["route"], s["prompt_version"]): s for s in first["snapshot"]["series"]}
    cards = {(c["route"], c["version"]): c for c in view["cards"]}
    routes = {w.name: w.route for w in workloads}
    expected = {(routes[r.workload], r.layout) for r in run.results}
    assert set(snapshot) == set(cards) == expected and len(expected) == 4
    for r in run.results:
        key = (routes[r.workload], r.layout)
        row, figs = snapshot[key], cards[key]["figs"]
        assert row["requests"] == r.requests == count(figs["requests"]), key
        pairs = {
            "ttft.p50": r.ttft_p50,
            "ttft.p95": r.ttft_p95,
            "itl.p50": r.itl_p50,
            "itl.p95": r.itl_p95,
            "tpot.p50": r.tpot_p50,
        }
        for fig, table in pairs.items():
            figure, q = fig.split(".")
            assert row[figure]["exact"] is True, (key, fig)
            # The same requests, the same quantile: equal to the last bit, and shown alike.
            assert row[figure][q] == table, (key, fig, row[figure][q], table)
            near(figs[fig], table, f"{key} {fig}")
        # No percentile past the slowest request it rests on.
        ttfts = [x["ttft"] for x in first["requests"] if (x["route"], x["prompt_version"]) == key]
        assert len(ttfts) == r.requests
        assert row["ttft"]["p99"] * 1000 <= max(ttfts) + 1e-3, key
