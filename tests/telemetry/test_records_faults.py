"""The faults a production proxy meets, end to end: no record is lost silently (DESIGN.md).

``llmtap serve --record DIR`` (with ClickHouse or an OTLP backend where the fault needs one) runs in front of the
offline simulator; a bounded client load goes through it while the fault happens; then the ledger
(``tests.support.fault_ledger``) checks that every request sent has its record, or that the difference is counted on
``/metrics`` and said in the log with its cause. Each test publishes its ledger (``LEDGER {...}`` in its output,
and the file ``LLMTAP_FAULT_TABLE`` names) for the table of the issue's closing note.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import resource
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmtap.relay.app import STATS_EVERY
from llmtap.store.files import ReadStats, find, read_file, read_records
from llmtap.store.skips import Skips
from tests.conftest import PATIENCE, require_real
from tests.support.clickhouse_server import HOW, ClickHouseProcess, installed
from tests.support.fault_ledger import REASON, Counters, Ledger, changes, check, ledger, loss_lines, read_folder
from tests.support.fault_load import Load, OTLPBackend, Outcome, begun_after, wait_for
from tests.support.procs import Llmtap, Simulator
from tests.support.proctree import TELEMETRY_COMM

pytestmark = pytest.mark.e2e

#: Requests of a fault's load: enough that a fault lands in the middle of traffic, few enough for CI.
SENT = 400
#: Telemetry processes killed during one load.
KILLS = 6
#: Requests begun while a killed telemetry process is away (before the load waits for the new one).
AWAY = SENT // 40
#: How long the counts of records and losses must stand still before a fault's books are closed.
QUIET = 3.0


@pytest.fixture(scope="module")
def simulator() -> Iterator[Simulator]:
    sim = Simulator("fast")
    yield sim
    sim.close()


def serve(
    sim: Simulator,
    tmp_path: Path,
    name: str,
    *args: str,
    env: dict[str, str] | None = None,
    setsid: bool = False,
    preexec_fn: Callable[[], None] | None = None,
) -> Llmtap:
    """``llmtap serve`` in front of the simulator, its log in ``tmp_path/NAME.log``; its state (what an install
    remembers) in ``tmp_path``, so a start again on the same folder finds what the last one left. ``setsid``: in a
    process group of its own, which ``os.killpg`` kills whole."""

    def prepare() -> None:
        if setsid:
            os.setsid()
        if preexec_fn is not None:
            preexec_fn()

    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    return Llmtap(
        sim.url,
        tmp_path / f"{name}.log",
        *args,
        env={"XDG_STATE_HOME": str(state), **(env or {})},
        preexec_fn=prepare if setsid or preexec_fn else None,
    )


def stop_gracefully(proxy: Llmtap) -> None:
    """SIGTERM, as an orchestrator stops a pod: it exits 0 within PATIENCE."""
    proxy.terminate()
    assert proxy.proc.wait(PATIENCE) == 0, proxy.logs()[-3000:]
    proxy.close()


def settle(progress: object, target: int, quiet: float = QUIET) -> int:
    """Wait until ``progress()`` (records plus counted losses) reaches ``target`` or stands still for ``quiet``
    seconds (within PATIENCE); its last value."""
    assert callable(progress)
    deadline = time.monotonic() + PATIENCE
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = int(progress())
        if now >= target:
            return now
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
        time.sleep(0.2)
    return last


def telemetry_pid(proxy: Llmtap) -> int | None:
    """The telemetry process now, or None while it is being started again."""
    path = Path(f"/proc/{proxy.proc.pid}/task/{proxy.proc.pid}/children")
    for pid in path.read_text().split():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == TELEMETRY_COMM:
                return int(pid)
        except OSError:
            continue
    return None


def ready_telemetry(proxy: Llmtap, other_than: int | None) -> int:
    """Wait until a telemetry process other than ``other_than`` runs and serves ``/metrics``; its pid.

    Not ``/readyz``: a telemetry process started again hears of the relay's readiness only with its next report,
    which an idle relay does not send."""

    def ready() -> int | None:
        pid = telemetry_pid(proxy)
        if pid is None or pid == other_than:
            return None
        try:
            return pid if httpx.get(proxy.admin_url + "/metrics", timeout=2).status_code == 200 else None
        except httpx.HTTPError:
            return None

    found: int = wait_for("a telemetry process started again", ready, PATIENCE, step=0.05)
    return found


def kill_under_load(proxy: Llmtap, load: Load) -> list[int]:
    """SIGKILL to the telemetry process ``KILLS`` times during ``load`` (``SENT`` requests); the requests issued
    at each kill.

    Each kill lands with requests in flight, and requests go on while the process is away (``AWAY`` of them), then
    the load waits for the new process: however slow its start on a busy machine, every kill comes under load."""
    pid = ready_telemetry(proxy, None)
    at: list[int] = []
    for k in range(1, KILLS + 1):
        turn = k * SENT // (KILLS + 1)
        wait_for(f"kill {k}'s turn", lambda: load.issued >= turn, PATIENCE)  # noqa: B023 (waited for here)
        assert load.running, f"the load ended before kill {k}"
        os.kill(pid, signal.SIGKILL)
        at.append(load.issued)
        wait_for("requests while it is away", lambda: load.issued >= turn + AWAY, PATIENCE)  # noqa: B023
        load.pause()
        pid = ready_telemetry(proxy, pid)
        load.resume()
    return at


# --- the faults ------------------------------------------------------------------------------------------------


def test_telemetry_process_killed_six_times_under_load(simulator: Simulator, tmp_path: Path) -> None:
    """SIGKILL to the telemetry process six times during 400 requests; ``llmtap serve`` starts it again each time
    (``kill_under_load``)."""
    records = tmp_path / "records"
    proxy = serve(simulator, tmp_path, "llmtap", "--record", str(records))
    try:
        with Counters(lambda: [proxy.admin_url]) as counters:
            load = Load(proxy.url, SENT, concurrency=8).start()
            at = kill_under_load(proxy, load)
            outcomes = load.join(PATIENCE)

            def progress() -> int:
                kept = read_folder(records).traces
                return sum(1 for o in outcomes if o.trace_id in kept) + sum(counters.losses("files").values())

            settle(progress, len(outcomes))
            counters.scrape()
        stop_gracefully(proxy)
    finally:
        proxy.close()
    found = read_folder(records)
    book = ledger("telemetry SIGKILL x6", "files", outcomes, found.traces, counters, proxy.logs(), found.copies)
    book.notes |= {
        "kills_at_request": at,
        "resets": counters.resets,
        "restarts": counters.restarts,
        "losses": changes(counters.history),
    }
    check(book)


#: A request's own id, where a record keeps it when tracing is off (its trace and span ids are then zeros).
TAG = "x-llmtap-prompt-version"


def untraced_records(folder: Path) -> tuple[dict[str, set[str]], int, int]:
    """The records in ``folder`` read as ``read_folder`` reads them: record ids by the request's tag (its prompt
    version), the copies the reader counted once, and the records the files hold (copies included)."""
    stats = ReadStats()
    kept: dict[str, set[str]] = {}
    for record in read_records(folder, stats):
        assert record["trace_id"] == "0" * 32 and record["span_id"] == "0" * 16, record  # tracing was off
        kept.setdefault(str(record["prompt_version"]), set()).add(str(record["record_id"]))
    lines = sum(1 for file in find([folder]).files for _ in read_file(file, Skips()))
    return kept, stats.skips.counts.get("duplicate", 0), lines


def test_telemetry_killed_under_load_with_tracing_off_records_each_request_once(
    simulator: Simulator, tmp_path: Path
) -> None:
    """Tracing off (``OTEL_SDK_DISABLED``): every record's trace and span ids are zeros, and the journal's replay after
    each of six kills can write a record again. Each request has one record all the same, told by its record_id:
    the reader keeps one copy of each, and no request has two records.

    With the SDK off there is no ``/metrics`` to count losses on (their log lines stay): the books of what was lost
    are the test above's; this one checks that what was kept is kept once."""
    records = tmp_path / "records"
    proxy = serve(simulator, tmp_path, "llmtap", "--record", str(records), env={"OTEL_SDK_DISABLED": "true"})
    try:
        with Counters(lambda: [proxy.admin_url]) as counters:
            load = Load(proxy.url, SENT, concurrency=8, tag=TAG).start()
            at = kill_under_load(proxy, load)
            outcomes = load.join(PATIENCE)

            settle(lambda: len(untraced_records(records)[0]), len(outcomes))
        stop_gracefully(proxy)
    finally:
        proxy.close()
    kept, copies, lines = untraced_records(records)
    twice = {tag: ids for tag, ids in kept.items() if len(ids) > 1}
    assert not twice, f"requests with more than one record: {twice}"
    book = ledger("telemetry SIGKILL x6, tracing off", "files", outcomes, kept, counters, proxy.logs(), copies)
    book.notes |= {"kills_at_request": at, "records_in_files": lines}
    book.publish()
    assert book.foreign == 0 and book.sent == SENT and book.recorded > 0, book.row()
    assert lines == book.recorded + copies, book.row()  # every record in the files is a request's or a counted copy


#: Seconds a restarted telemetry process may take to hear the relay is ready: a few of its report intervals
#: (``llmtap.relay.app.STATS_EVERY``), on a busy machine.
READY_AGAIN = 10 * STATS_EVERY


def test_readyz_answers_again_after_an_idle_telemetry_restart(simulator: Simulator, tmp_path: Path) -> None:
    """A telemetry process killed and started again while no request comes: ``/readyz`` says ready again within a
    few report intervals (the relay reports its readiness as soon as its channel is made again), not at the next
    request."""
    proxy = serve(simulator, tmp_path, "llmtap", "--record", str(tmp_path / "records"))
    try:
        pid = ready_telemetry(proxy, None)
        wait_for("ready", lambda: httpx.get(proxy.admin_url + "/readyz", timeout=2).status_code == 200, PATIENCE)
        os.kill(pid, signal.SIGKILL)
        ready_telemetry(proxy, pid)

        def ready() -> str | None:
            answer = httpx.get(proxy.admin_url + "/readyz", timeout=2)
            return answer.text if answer.status_code == 200 else None

        said = wait_for("/readyz after the restart, no request sent", ready, READY_AGAIN, step=0.1)
        assert "1/1 relays" in said
        stop_gracefully(proxy)
    finally:
        proxy.close()


class Restarts:
    """An llmtap started, killed and started again on the same folder: the one running now, for the counters."""

    def __init__(self) -> None:
        self.now: Llmtap | None = None

    def urls(self) -> list[str]:
        return [self.now.admin_url] if self.now is not None and self.now.proc.poll() is None else []

    def url(self) -> str:
        assert self.now is not None
        return self.now.url


def test_whole_tree_killed_and_started_again_on_the_same_folder(simulator: Simulator, tmp_path: Path) -> None:
    """SIGKILL to every llmtap process at once (an OOM kill, a node lost) in the middle of 400 requests; then
    ``llmtap serve`` again on the same record folder and state, as a pod restarted on its volume is."""
    records = tmp_path / "records"
    tree = Restarts()
    outcomes: list[Outcome] = []
    try:
        tree.now = serve(simulator, tmp_path, "first", "--record", str(records), setsid=True)
        first = tree.now
        with Counters(tree.urls) as counters:
            load = Load(tree.url, SENT, concurrency=8).start()
            wait_for("half the load", lambda: load.issued >= SENT // 2, PATIENCE)
            killed = time.monotonic()
            os.killpg(first.proc.pid, signal.SIGKILL)
            killed_at = load.issued
            first.proc.wait(PATIENCE)
            load.stop()
            outcomes += begun_after(load.join(PATIENCE), killed)
            first.close()
            tree.now = serve(simulator, tmp_path, "again", "--record", str(records))
            outcomes += Load(tree.url, SENT // 10, concurrency=4).start().join(PATIENCE)

            def progress() -> int:
                kept = read_folder(records).traces
                return sum(1 for o in outcomes if o.trace_id in kept) + sum(counters.losses("files").values())

            settle(progress, sum(o.kind != "refused" for o in outcomes))
            counters.scrape()
        stop_gracefully(tree.now)
    finally:
        if tree.now is not None:
            tree.now.close()
    log = first.logs() + tree.now.logs()
    found = read_folder(records)
    book = ledger("whole tree SIGKILL, restart", "files", outcomes, found.traces, counters, log, found.copies)
    book.notes |= {"killed_at_request": killed_at, "start_again_said": loss_lines(tree.now.logs())}
    check(book)


def test_clickhouse_down_across_a_restart(simulator: Simulator, tmp_path: Path) -> None:
    """ClickHouse stops; requests go on; llmtap is stopped (SIGTERM, a rolling restart) and started again; ClickHouse
    comes back: every row arrives, or each missing one is counted."""
    require_real(installed(), "ClickHouse (clickhouse-server)", HOW)
    ch = ClickHouseProcess(tmp_path / "clickhouse")
    ch.start(PATIENCE)
    table = f"faults_{secrets.token_hex(4)}"
    args = ("--record", str(tmp_path / "records"), "--record-clickhouse", ch.url, "--record-clickhouse-table", table)
    tree = Restarts()
    outcomes: list[Outcome] = []
    try:
        tree.now = serve(simulator, tmp_path, "first", *args)
        with Counters(tree.urls) as counters:
            outcomes += Load(tree.url, 10, concurrency=2).start().join(PATIENCE)
            wait_for("the first rows", lambda: len(rows(ch, table)) >= 10, PATIENCE)
            ch.stop()
            outcomes += Load(tree.url, SENT // 10, concurrency=4).start().join(PATIENCE)
            time.sleep(1.0)  # the sink has tried ClickHouse and found it down
            counters.scrape()
            stop_gracefully(tree.now)
            first = tree.now
            ch.start(PATIENCE)
            tree.now = serve(simulator, tmp_path, "again", *args)
            sent = sum(o.kind != "refused" for o in outcomes)
            settle(lambda: rows_of(ch, table, outcomes) + sum(counters.losses("clickhouse").values()), sent)
            counters.scrape()
        stop_gracefully(tree.now)
        kept = rows(ch, table)
        # Rows written twice (an at-least-once replay), before ClickHouse merges them away if it does.
        copies = int(ch.query(f"SELECT count() FROM {table}")) - sum(len(spans) for spans in kept.values())
    finally:
        if tree.now is not None:
            tree.now.close()
        ch.stop()
    log = first.logs() + tree.now.logs()
    book = ledger("ClickHouse down across a restart", "clickhouse", outcomes, kept, counters, log, copies)
    check(book)


def rows(ch: ClickHouseProcess, table: str) -> dict[str, set[str]]:
    """The rows of ``table``: distinct span ids by trace id (none while ClickHouse is down or the table missing)."""
    try:
        text = ch.query(f"SELECT DISTINCT trace_id, ifNull(span_id, '') FROM {table} FORMAT TabSeparated")
    except OSError:
        return {}
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        trace, _, span = line.partition("\t")
        out.setdefault(trace, set()).add(span)
    return out


def rows_of(ch: ClickHouseProcess, table: str, outcomes: list[Outcome]) -> int:
    kept = rows(ch, table)
    return sum(1 for o in outcomes if o.trace_id in kept)


#: The small disk of the full-disk fault: some of the load's records fit, most do not.
DISK_BYTES = 256 << 10


@contextlib.contextmanager
def small_disk(where: Path) -> Iterator[Callable[[], None] | None]:
    """A tmpfs of ``DISK_BYTES`` mounted at ``where`` (root only); when it cannot be mounted, the same bound as a
    file-size limit of llmtap's processes instead (``RLIMIT_FSIZE``: the kernel writes what fits, then refuses),
    given as the ``preexec_fn`` to start them with."""
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "llmtap-faults", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        print(f"\nno tmpfs ({done.stderr.strip()}): the disk is a {DISK_BYTES}-byte file-size limit instead")

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (DISK_BYTES, DISK_BYTES))

        yield limit
        return
    try:
        yield None
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_disk_full(simulator: Simulator, tmp_path: Path) -> None:
    """The record folder's disk fills up during 420 requests: each record is on disk whole, or counted."""
    sent_here = 420
    with small_disk(tmp_path / "disk") as limit:
        records = tmp_path / "disk" / "records"
        proxy = serve(simulator, tmp_path, "llmtap", "--record", str(records), preexec_fn=limit)
        try:
            with Counters(lambda: [proxy.admin_url]) as counters:
                outcomes = Load(proxy.url, sent_here, concurrency=8).start().join(PATIENCE)

                def progress() -> int:
                    kept = read_folder(records).traces
                    return sum(1 for o in outcomes if o.trace_id in kept) + sum(counters.losses("files").values())

                settle(progress, sent_here)
                counters.scrape()
            stop_gracefully(proxy)
        finally:
            proxy.close()
        found = read_folder(records)
    book = ledger("disk full", "files", outcomes, found.traces, counters, proxy.logs(), found.copies)
    book.notes |= {"torn_lines": found.stats.truncated, "tmpfs": limit is None}
    assert 0 < book.recorded < book.sent, "the disk was never full, or full from the start"
    check(book)
    said = [line for line in proxy.logs().splitlines() if "record folder" in line]
    assert said, "the log never says the record folder could not be written"


#: Spans and log records leave at once, and an export to a backend that is down fails within a second.
OTLP_ENV = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_METRICS_EXPORTER": "none",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
    "OTEL_BSP_SCHEDULE_DELAY": "100",
    "OTEL_BLRP_SCHEDULE_DELAY": "100",
    # One span per phase and none per chunk: every request makes the same number of spans.
    "LLMTAP_CHUNK_SPANS": "off",
    # A queue the outage fills: what it cannot hold is dropped and counted.
    "LLMTAP_TELEMETRY_QUEUE": "256",
}


def spans_per_request(backend: OTLPBackend, outcomes: list[Outcome]) -> int:
    """The spans each of these requests made, once all of them reached the backend (the same for each)."""
    traces = {o.trace_id for o in outcomes}

    def counts() -> set[int] | None:
        seen = {len(backend.spans.get(t, ())) for t in traces}
        return seen if 0 not in seen else None

    wait_for("the spans of the first requests", counts, PATIENCE)
    time.sleep(1.0)  # a request's spans may come in two exports
    per = counts()
    assert per is not None and len(per) == 1, f"requests made different numbers of spans: {per}"
    return per.pop()


def test_otlp_backend_down_for_a_while(simulator: Simulator, tmp_path: Path) -> None:
    """The OTLP backend (traces, and records as log records) refuses connections during 300 of 400 requests, then
    comes back: every span and log record reaches it or is counted lost; the record files lose nothing."""
    backend = OTLPBackend()
    records = tmp_path / "records"
    env = {**OTLP_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": backend.url}
    proxy = serve(simulator, tmp_path, "llmtap", "--record", str(records), "--record-logs", "true", env=env)
    try:
        with Counters(lambda: [proxy.admin_url]) as counters:
            outcomes = Load(proxy.url, SENT // 20, concurrency=4).start().join(PATIENCE)
            per = spans_per_request(backend, outcomes)
            backend.down()
            outcomes += Load(proxy.url, SENT * 3 // 4, concurrency=8, rate=60.0).start().join(PATIENCE)
            time.sleep(2.0)  # down a while longer: the exporters' retries give up
            backend.up()
            outcomes += Load(proxy.url, SENT - len(outcomes), concurrency=8).start().join(PATIENCE)
            sent = sum(o.kind != "refused" for o in outcomes)
            traces = {o.trace_id for o in outcomes}

            def progress() -> int:
                spans = backend.span_count(traces) + counters.value(SPANS_DROPPED)
                return min(int(spans) // per, backend.log_traces(traces) + sum(counters.losses("logs").values()))

            settle(progress, sent)
            counters.scrape()
        stop_gracefully(proxy)
    finally:
        proxy.close()
        backend.close()
    log = proxy.logs()
    found = read_folder(records)
    files = ledger("OTLP down: record files", "files", outcomes, found.traces, counters, log, found.copies)
    logs = ledger("OTLP down: records as log records", "logs", outcomes, backend.log_records(), counters, log)
    spans = span_ledger("OTLP down: spans", outcomes, per, backend, counters, log)
    for book in (files, logs, spans):
        book.publish()
    for book in (files, logs, spans):
        check(book)
    assert files.recorded == files.sent, "the record files lost records to an OTLP outage"


SPANS_DROPPED = "llmtap_telemetry_spans_dropped_total"


def span_ledger(
    fault: str, outcomes: list[Outcome], per: int, backend: OTLPBackend, counters: Counters, log: str
) -> Ledger:
    """The spans' ledger: ``per`` spans for each request sent, against the distinct spans the backend received;
    lost: the spans-dropped counter, and ``per`` for each tape lost whole (its spans were never made)."""
    sent = [o for o in outcomes if o.kind != "refused"]
    traces = {o.trace_id for o in sent}
    tapes = sum(v for k, v in counters.losses("spans").items() if k.startswith("tape:"))
    counted = {f"span:{r}": int(v) for r, v in counters.by_label(SPANS_DROPPED, REASON).items() if v}
    if tapes:
        counted["tape (spans)"] = per * tapes
    received = backend.span_count(traces)
    said = [line for line in loss_lines(log) if "span" in line.lower()]
    book = Ledger(fault, "spans", per * len(sent), 0, 0, received, 0, 0, counted, said)
    book.notes = {"spans_per_request": per}
    return book


def _split(files: list[Path], count: int) -> list[Path]:
    """``count`` of ``files`` spread over the list (neither all old nor all new)."""
    step = max(1, len(files) // count)
    return files[::step][:count]


#: The name a damaged folder's garbage Parquet file gets (a file the duckdb engine reads; plain Python reads none).
JUNK_PARQUET = "junk.parquet"


def damage(records: Path) -> dict[str, set[str]]:
    """Damage the closed files of a record folder as disks and people do: a compressed file cut short, an empty one,
    one of garbage, and one whose last line is torn. The trace ids each damaged file held (the torn one: its last
    line's), by file name."""
    closed = sorted(p for p in records.rglob("*.jsonl.gz"))
    assert len(closed) >= 5, f"only {len(closed)} closed files to damage"
    held = {p.name: set(read_folder(p).traces) for p in closed}
    cut, empty, garbage, torn = _split(closed, 4)
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    empty.write_bytes(b"")
    garbage.write_bytes(secrets.token_bytes(2048))
    lines = gzip.decompress(torn.read_bytes()).splitlines(keepends=True)
    torn.unlink()
    plain = torn.with_name(torn.name.removesuffix(".gz"))
    plain.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    damaged = {f.name: held[f.name] for f in (cut, empty, garbage)}
    return damaged | {plain.name: {json.loads(lines[-1])["trace_id"]}}


def analyse(command: str, engine: str, records: Path) -> tuple[dict[str, Any] | None, str]:
    """``llmtap compare`` or ``llmtap slo`` on the folder with ``--json``: its figures (None when it failed), and
    all it printed."""
    argv = [sys.executable, "-m", "llmtap", command, str(records), "--engine", engine, "--json"]
    if command == "compare":
        argv += ["--before", "v1", "--after", "v2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=PATIENCE, check=False)
    said = done.stdout + done.stderr
    if done.returncode != 0 or "Traceback" in said:
        return None, f"exit {done.returncode}: {said[-3000:]}"
    figures: dict[str, Any] = json.loads(done.stdout)
    return figures, said


def requests_read(figures: dict[str, Any]) -> int:
    """The requests ``compare`` (both sides) or ``slo`` (every verdict) answered from."""
    if "before" in figures:
        return int(figures["before"]["requests"]) + int(figures["after"]["requests"])
    return sum(int(v["requests"]) for v in figures["verdicts"])


def test_damaged_files_in_the_record_folder(simulator: Simulator, tmp_path: Path) -> None:
    """Files of a record folder damaged after the fact: ``compare`` and ``slo``, both engines, skip what they cannot
    read, name each damaged file and count what they skipped, and answer from the rest."""
    records = tmp_path / "records"
    proxy = serve(simulator, tmp_path, "llmtap", "--record", str(records), "--record-max-mb", "0.02")
    try:
        outcomes: list[Outcome] = []
        for version in ("v1", "v2"):
            load = Load(proxy.url, SENT // 4, concurrency=4, headers={"x-llmtap-prompt-version": version})
            outcomes += load.start().join(PATIENCE)
        settle(lambda: sum(1 for o in outcomes if o.trace_id in read_folder(records).traces), len(outcomes))
        stop_gracefully(proxy)
    finally:
        proxy.close()
    whole = read_folder(records)
    held = damage(records)
    # What llmtap's reader still reads (the rows of a cut file before its damage too); the rest is lost, and each
    # lost record must be in a file the tools named.
    readable = read_folder(records).traces
    lost = set(whole.traces) - set(readable)
    assert lost <= set().union(*held.values()), "records lost from files that were not damaged"
    named: dict[str, set[str]] = {}
    failed: dict[str, str] = {}
    read: dict[str, int] = {}
    for engine in ("python", "duckdb"):
        if engine == "duckdb":  # Parquet is the engine's alone to read
            (records / JUNK_PARQUET).write_bytes(b"PAR1" + secrets.token_bytes(512) + b"PAR1")
            held[JUNK_PARQUET] = set()
        for command in ("compare", "slo"):
            who = f"{command} {engine}"
            figures, said = analyse(command, engine, records)
            if figures is None:
                failed[who] = said
                continue
            named[who] = {n for n in held if n in said}
            read[who] = requests_read(figures)
    everywhere = set.intersection(*named.values()) if named and not failed else set()
    counted = set().union(*(held[n] for n in everywhere)) if everywhere else set()
    book = ledger("damaged record files", "files", outcomes, readable, Counters(list), "")
    book.counted = {"in files compare and slo named": len(counted & lost)}
    book.said = sorted(everywhere)
    book.notes |= {"damaged": sorted(held), "named": {k: sorted(v) for k, v in named.items()}, "failed": sorted(failed)}
    book.publish()
    assert not failed, "\n".join(f"{who} failed: {said}" for who, said in failed.items())
    for who, names in named.items():
        wanted = set(held) - ({JUNK_PARQUET} if who.endswith("python") else set())
        assert names == wanted, f"{who} did not name {sorted(wanted - names)}"
        assert read[who] == len(readable), f"{who} answered from {read[who]} records, not {len(readable)}"
    check(book)
