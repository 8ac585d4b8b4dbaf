"""The memory soak's probe: inside each llmtap process, how full every bounded structure is, once in a while.

``python -m bench.probes.soak --memory`` starts ``llmtap serve`` with ``bench/probes/soak_site`` first on
``PYTHONPATH``: its
``sitecustomize`` calls ``start`` in every Python process of the tree when ``SOAK_PROBE_DIR`` is set. A daemon
thread waits until the process holds llmtap's recorder (the telemetry process) or relay app (the relay), found
once from the running tasks, then every ``SOAK_PROBE_EVERY`` seconds appends one JSON line of sizes to
``probe-<pid>.jsonl``: entries of each cache, table and queue named in ``docs/memory.md``, and every
``GC_EVERY`` seconds the objects the collector tracks (those made after start-up: llmtap freezes the rest). It
reads private fields of llmtap and of the OpenTelemetry SDK (a measurement, not an interface): a size it cannot
read is ``null``, and llmtap runs as it would without it (the thread only reads lengths, each atomic under the
GIL).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["start"]

#: Seconds between full object counts (a walk of the heap: tens of milliseconds).
GC_EVERY = 60.0


def start() -> None:
    """Start the probe thread, if ``SOAK_PROBE_DIR`` names a folder."""
    folder = os.environ.get("SOAK_PROBE_DIR")
    if folder:
        every = float(os.environ.get("SOAK_PROBE_EVERY", "10"))
        threading.Thread(target=_run, args=(folder, every), name="soak-probe", daemon=True).start()


def _run(folder: str, every: float) -> None:
    found: tuple[str, Callable[[], dict[str, Any]]] | None = None
    while found is None:
        time.sleep(1.0)
        try:
            found = _find()
        except Exception:  # a module still being imported: look again
            found = None
    role, sizes = found
    path = os.path.join(folder, f"probe-{os.getpid()}.jsonl")
    counted = 0.0
    with open(path, "a", encoding="utf-8") as out:
        while True:
            line: dict[str, Any] = {"t": time.monotonic(), "pid": os.getpid(), "role": role}
            try:
                line |= sizes()
            except Exception as exc:  # a measurement that failed says so, and the next one tries again
                line["error"] = repr(exc)
            line |= _allocator()
            if time.monotonic() - counted >= GC_EVERY:
                counted = time.monotonic()
                line["gc_objects"] = len(gc.get_objects())
            out.write(json.dumps(line) + "\n")
            out.flush()
            time.sleep(every)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ]


def _allocator() -> dict[str, int]:
    """What the allocators hold: Python's live blocks (``sys.getallocatedblocks``), and C's (glibc ``mallinfo2``,
    every arena): in use, free inside its arenas, and mapped in all. Live blocks flat while the process grows is
    fragmentation, not a structure growing."""
    out = {"python_blocks": sys.getallocatedblocks()}
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):  # not glibc
        return out
    mallinfo2.restype = _MallInfo2
    m = mallinfo2()
    out |= {"malloc_in_use": m.uordblks + m.hblkhd, "malloc_free": m.fordblks, "malloc_mapped": m.arena + m.hblkhd}
    return out


def _find() -> tuple[str, Callable[[], dict[str, Any]]] | None:
    recorder_module = sys.modules.get("llmtap.telemetry.recorder")
    if recorder_module is not None:
        recorder = _held(recorder_module.Recorder)
        if recorder is not None:
            return "telemetry", _telemetry(recorder)
    app_module = sys.modules.get("llmtap.relay.app")
    if app_module is not None:
        app = _held(app_module.ProxyApp)
        if app is not None:
            return "relay", _relay(app)
    return None


def _held(kind: type) -> Any:
    """An instance of ``kind`` the process's running tasks hold (their locals, and what those hold, three deep).

    Not through ``gc.get_objects()``: llmtap freezes what it made at start-up (``gc.freeze``), and frozen objects
    are not listed."""
    import asyncio.tasks

    tasks = list(asyncio.tasks._all_tasks)  # type: ignore[attr-defined]
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = []
    for task in tasks:
        coro = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
            if frame is not None:
                todo += [(value, 0) for value in frame.f_locals.values()]
            coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    while todo:  # breadth first: what is seen is seen at its least depth
        obj, depth = todo.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, kind):
            return obj
        if depth < 3 and not isinstance(obj, type):
            todo += [(value, depth + 1) for value in _parts(obj)]
    return None


def _parts(obj: Any) -> list[Any]:
    """What ``obj`` holds: its attributes (``__dict__`` or slots), or a short sequence's items."""
    if isinstance(obj, (tuple, list)):
        return list(obj[:64])
    out = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                out.append(getattr(obj, name))
    return out


def _size(read: Callable[[], int]) -> int | None:
    try:
        return int(read())
    except Exception:
        return None


def _sizes(table: dict[str, tuple[Callable[[], int], Callable[[], int] | None]]) -> dict[str, int | None]:
    """Each name's size now, and its bound (``<name>_bound``) where it has one."""
    out: dict[str, int | None] = {}
    for name, (size, bound) in table.items():
        out[name] = _size(size)
        if bound is not None:
            out[f"{name}_bound"] = _size(bound)
    return out


def _telemetry(rec: Any) -> Callable[[], dict[str, Any]]:
    from llmtap.analysis import cost, estimator, tokens
    from llmtap.telemetry.admin.live.window import LiveWindow
    from llmtap.telemetry.emit import otlp_spans

    # Both found again once in a while: the live view's window and the SDK's aggregations come after the recorder.
    from llmtap.telemetry.exposition.prometheus import PrometheusReader
    from llmtap.telemetry.fleet import peers, serverspans

    windows, matches, readers = [_windows(rec, LiveWindow)], [_sdk_matches(rec)], [_readers(PrometheusReader)]
    checked = [time.monotonic()]
    join, est, streams, cache = rec.wait.join, rec.estimator, rec.streams, rec.analysis.cache
    table: dict[str, tuple[Callable[[], int], Callable[[], int] | None]] = {
        "queue": (rec._queue.qsize, lambda: rec._queue.maxsize),
        "open_streams": (lambda: streams.open, lambda: streams._limit),
        "gone_streams": (lambda: streams.gone, lambda: streams._gone_limit),
        "prefix_index": (lambda: len(cache._index), lambda: cache._index._capacity),
        "token_counts": (lambda: len(cache._counts._counts), lambda: cache._counts._capacity),
        "short_token_counts": (
            lambda: sum(len(v) for v in tokens._short.values()),
            lambda: tokens.SHORT_KEPT * len(tokens._short),
        ),
        "join_held": (lambda: len(join._held), lambda: serverspans.MAX_HELD),
        "join_held_chars": (lambda: join.held_size, lambda: serverspans.MAX_HELD_CHARS),
        "join_early": (lambda: len(join._early), lambda: serverspans.MAX_EARLY),
        "join_recent": (lambda: len(join._recent), lambda: serverspans.MAX_RECENT),
        "trace_ids_known": (lambda: len(rec.owned._known), lambda: peers.MAX_KNOWN),
        "spans_waiting": (lambda: rec.owned.waiting, lambda: peers.MAX_WAITING),
        "spans_waiting_bytes": (lambda: rec.owned.waiting_bytes, lambda: peers.MAX_WAITING_BYTES),
        "estimator_envelopes": (lambda: est.models, lambda: estimator.MAX_MODELS),
        "estimator_completions": (
            lambda: sum(len(u.log._ends) + len(u.log._decoding) for u in est._upstreams.values()),
            lambda: sum(2 * u.log.maxlen for u in est._upstreams.values()),
        ),
        "price_memo": (lambda: len(rec.analysis.prices._memo), lambda: cost.MEMO),
        "otlp_keys": (lambda: len(otlp_spans._KEYS), lambda: otlp_spans._KEYS_KEPT),
        "live_samples": (lambda: sum(w._kept for w in windows[0]), lambda: sum(w._budget for w in windows[0])),
        "live_requests": (
            lambda: sum(len(w._requests) for w in windows[0]),
            lambda: sum(w._requests.maxlen or 0 for w in windows[0]),
        ),
        "live_series": (lambda: sum(len(w._series) for w in windows[0]), None),
        "sdk_attribute_sets": (
            lambda: sum(len(x._attributes_aggregation) for x in matches[0]),
            lambda: sum(x._cardinality_limit + 1 for x in matches[0]),  # + the overflow series
        ),
        # Exemplars: the SDK's, one per histogram bucket (and a few per counter) of each set, and those
        # llmtap's /metrics keeps per bucket of each histogram series.
        "sdk_exemplar_buckets": (lambda: _exemplar_buckets(matches[0]), None),
        "exemplars_kept": (lambda: sum(len(v) for r in readers[0] for v in list(r._kept.values())), None),
    }
    m = rec.metrics
    guards = {"model": m._models, "version": m._versions, "error": m._errors}
    guards |= {f"dimension_{name}": guard for name, guard in m._dimensions.items()}
    for name, guard in guards.items():
        table |= _guard(f"labels_{name}", guard)

    def sizes() -> dict[str, Any]:
        if time.monotonic() - checked[0] >= GC_EVERY:
            windows[0], matches[0], checked[0] = _windows(rec, LiveWindow), _sdk_matches(rec), time.monotonic()
            readers[0] = _readers(PrometheusReader)
        return _sizes(table)

    return sizes


def _guard(name: str, g: Any) -> dict[str, tuple[Callable[[], int], Callable[[], int] | None]]:
    """A label guard's members, candidates and values ever labelled (bounded by time, not by count)."""
    return {
        name: (lambda: len(g._members), lambda: g._slots),
        f"{name}_candidates": (lambda: len(g._waiting), lambda: g._candidates),
        f"{name}_ever": (lambda: len(g._ever), None),
    }


def _readers(kind: type) -> list[Any]:
    found = _held(kind)
    return [] if found is None else [found]


def _exemplar_buckets(matches: list[Any]) -> int:
    total = 0
    for match in matches:
        for aggregation in list(match._attributes_aggregation.values()):
            reservoir = getattr(aggregation, "_reservoir", None)
            total += len(getattr(reservoir, "_reservoir_storage", ()))
    return total


def _windows(rec: Any, kind: type) -> list[Any]:
    """The live view's windows: recorder listeners."""
    return [listener for listener in rec.listeners if isinstance(listener, kind)]


def _sdk_matches(rec: Any) -> list[Any]:
    """The OpenTelemetry SDK's aggregations behind the recorder's instruments: each holds one entry per attribute
    set (the SDK keeps every set it was given, up to its cardinality limit per instrument)."""
    consumer = next(
        (v._measurement_consumer for v in _parts(rec.instruments) if hasattr(v, "_measurement_consumer")), None
    )
    if consumer is None:
        return []
    return [
        match
        for storage in consumer._reader_storages.values()
        for matches in list(storage._instrument_view_instrument_matches.values())
        for match in matches
    ]


def _relay(app: Any) -> Callable[[], dict[str, Any]]:
    from llmtap.relay import forward

    table: dict[str, tuple[Callable[[], int], Callable[[], int] | None]] = {
        "inflight": (lambda: app.inflight, None),
        "targets": (lambda: len(app.upstreams._targets), lambda: forward.TARGETS),
        "tapes_dropped": (lambda: app.tapes_dropped, None),
    }
    return lambda: _sizes(table)
