"""Rendering a run's figures: one line per phase while it runs, Markdown tables at the end."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.stats import PathFigures

BEGIN = "<!-- figures:begin (written by python -m bench --write) -->"
END = "<!-- figures:end -->"


def _f(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def merged(row: Any) -> str:
    """The merged chunks of a figure (a ``PathFigures`` or its row), and those the upstream wrote together
    (late, its core busy: no path keeps those apart) after them where there were any."""
    get = row.get if isinstance(row, dict) else lambda key, default=None: getattr(row, key, default)
    by_upstream = get("merged_by_upstream", 0) or 0
    return f"{get('merged')}" + (f" +{by_upstream} by the upstream" if by_upstream else "")


def _pct(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.0f}%"


def phase_line(fig: PathFigures) -> str:
    """A one-line progress report."""
    return (
        f"{fig.path:>8} {fig.upstream:<5} x{fig.streams:<4} req {fig.requests:>4} fail {fig.failed} "
        f"ttft+ p50 {_f(fig.added_ttft_ms_p50)} p99 {_f(fig.added_ttft_ms_p99)} ms  "
        f"gap+ p50 {_f(fig.added_gap_ms_p50)} p99 {_f(fig.added_gap_ms_p99)} ms  merged {merged(fig)}  "
        f"{fig.chunks_per_s:.0f} chunks/s  cpu/1k {_f(fig.cpu_s_per_1000_chunks, 3)} s "
        f"(kernel {_pct(fig.cpu_system_share)})  "
        f"rss/stream {_f(fig.rss_kib_per_stream, 1)} KiB  "
        f"relay/telemetry cpu/1k {_f(fig.cpu_relay_s_per_1000_chunks, 3)}/"
        f"{_f(fig.cpu_telemetry_s_per_1000_chunks, 3)} s"
    )


def burst_line(row: dict[str, Any]) -> str:
    """A one-line progress report of one burst size."""
    return (
        f"{row['path']:>8} {row['upstream']:<5} burst {row['size']:<4} x{row['bursts']} req {row['requests']:>4} "
        f"complete {row['complete']} errors {row['errors']}  "
        f"ttft+ p50 {_f(row['added_ttft_ms_p50'])} p99 {_f(row['added_ttft_ms_p99'])} ms  "
        f"gap+ p99 {_f(row['added_gap_ms_p99'])} ms  merged {merged(row)}  "
        f"relay/telemetry cpu/1k {_f(row['cpu_relay_s_per_1000_chunks'], 3)}/"
        f"{_f(row['cpu_telemetry_s_per_1000_chunks'], 3)} s"
    )


ORDER = {"direct": 0, "nginx": 1, "llmtap": 2, "litellm": 3}


def _order(path: str) -> tuple[int, str]:
    return ORDER.get(path.split(":", 1)[0], 9), path


def _bursts_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| path | upstream | burst | bursts | requests (complete) | added TTFT p50 / p99 (ms) | "
        "over direct p50 / p99 (ms) | of which connect p50 / p99 (ms) | added gap p99 (ms) | merged | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["upstream"], r["size"], _order(r["path"]))):
        lines.append(
            f"| {r['path']} | {r['upstream']} | {r['size']} | {r['bursts']} | {r['requests']} ({r['complete']}) | "
            f"{_f(r['added_ttft_ms_p50'])} / {_f(r['added_ttft_ms_p99'])} | "
            f"{_f(r.get('over_direct_ttft_ms_p50'))} / {_f(r.get('over_direct_ttft_ms_p99'))} | "
            f"{_f(r.get('connect_ms_p50'))} / {_f(r.get('connect_ms_p99'))} | "
            f"{_f(r['added_gap_ms_p99'])} | {merged(r)} | {r['errors']} |"
        )
    return lines


def _tapes(value: Any) -> str:
    """Tapes dropped: the count, or n/a when llmtap does not export the counter (never a silent 0)."""
    return "n/a" if value is None else f"{value:.0f}"


def _cpu_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| path | upstream | scenario | chunks | relay CPU s / 1k chunks | telemetry CPU s / 1k chunks | "
        "processes (relay + telemetry) | relay RSS per open stream (KiB) | tapes dropped |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = [r for r in results.get("phases", []) if r.get("cpu_s") is not None]
    rows += [r for r in results.get("bursts", []) if r.get("cpu_s") is not None]

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r.get("upstream", "http"), r.get("scenario", "staggered"), r["streams"], _order(r["path"]))

    for r in sorted(rows, key=key):
        n = r["streams"]
        scenario = f"burst {n}" if r.get("scenario") == "burst" else f"{n} stream{'' if n == 1 else 's'}"
        procs = r.get("procs") or {}
        telemetry = _f(r.get("cpu_telemetry_s_per_1000_chunks"), 3) if r["path"].startswith("llmtap") else "–"
        tapes = _tapes(r.get("tapes_dropped")) if r["path"].startswith("llmtap") else "–"
        lines.append(
            f"| {r['path']} | {r.get('upstream', 'http')} | {scenario} | {r['chunks']} | "
            f"{_f(r.get('cpu_relay_s_per_1000_chunks'), 3)} | {telemetry} | "
            f"{procs.get('relay', '–')} + {procs.get('telemetry', '–')} | "
            f"{_f(r.get('rss_relay_kib_per_stream'), 1)} | {tapes} |"
        )
    return lines


def _us(value: Any) -> str:
    """CPU seconds per 1,000 chunks as microseconds per chunk."""
    return "–" if value is None else f"{1000 * value:.0f}"


def _less(mine: Any, floor: Any) -> Any:
    return mine - floor if mine is not None and floor is not None else None


def _one_core_table(results: dict[str, Any]) -> list[str]:
    """llmtap's rows beside nginx's of the same scenario: added TTFT and gap over nginx's, merged chunks, relay
    and telemetry CPU per chunk apart, tapes dropped. Empty when the run has no nginx row to compare with."""
    rows = [{**r, "scenario": "staggered"} for r in results.get("phases", [])]
    rows += [{**r, "scenario": "burst"} for r in results.get("bursts", [])]
    nginx = {(r["upstream"], r["scenario"], r["streams"]): r for r in rows if r["path"] == "nginx"}
    lines = [
        "| path | upstream | scenario | added TTFT p50 / p99 over nginx (ms) | added gap p99 over nginx (ms) | merged "
        "(nginx) | relay µs / chunk | telemetry µs / chunk | tapes dropped |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    mine = [r for r in rows if r["path"].startswith("llmtap") and (r["upstream"], r["scenario"], r["streams"]) in nginx]
    for r in sorted(mine, key=lambda r: (r["upstream"], r["scenario"], r["streams"], r["path"])):
        n = nginx[(r["upstream"], r["scenario"], r["streams"])]
        scenario = f"burst {r['streams']}" if r["scenario"] == "burst" else f"{r['streams']} staggered"
        lines.append(
            f"| {r['path']} | {r['upstream']} | {scenario} | "
            f"{_f(_less(r['added_ttft_ms_p50'], n['added_ttft_ms_p50']))} / "
            f"{_f(_less(r['added_ttft_ms_p99'], n['added_ttft_ms_p99']))} | "
            f"{_f(_less(r['added_gap_ms_p99'], n['added_gap_ms_p99']))} | {merged(r)} ({merged(n)}) | "
            f"{_us(r.get('cpu_relay_s_per_1000_chunks'))} | {_us(r.get('cpu_telemetry_s_per_1000_chunks'))} | "
            f"{_tapes(r.get('tapes_dropped'))} |"
        )
    return lines if len(lines) > 2 else []


def _phases_table(phases: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| path | upstream | streams | requests (failed) | added TTFT p50 / p99 (ms) | added gap p50 / p99 (ms) | "
        "merged | "
        "chunks/s | CPU s per 1000 chunks (kernel share) | idle CPU (ms/s) | RSS per open stream (KiB) | "
        "upstream late p99 (ms) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in sorted(phases, key=lambda p: (p.get("upstream", "http"), p["streams"], _order(p["path"]))):
        lines.append(
            f"| {p['path']} | {p.get('upstream', 'http')} | {p['streams']} | {p['requests']} ({p['failed']}) | "
            f"{_f(p['added_ttft_ms_p50'])} / {_f(p['added_ttft_ms_p99'])} | "
            f"{_f(p['added_gap_ms_p50'])} / {_f(p['added_gap_ms_p99'])} | {merged(p)} | "
            f"{_f(p['chunks_per_s'], 0)} | {_f(p['cpu_s_per_1000_chunks'], 3)} ({_pct(p.get('cpu_system_share'))}) | "
            f"{_f(p.get('idle_cpu_ms_per_s'), 1)} | {_f(p['rss_kib_per_stream'], 1)} | "
            f"{_f(p['upstream_late_ms_p99'])} |"
        )
    return lines


def _ratios(phases: list[dict[str, Any]]) -> list[str]:
    lines = ["| streams | llmtap added TTFT p50 (ms) | LiteLLM added TTFT p50 (ms) | ratio LiteLLM / llmtap |",
             "| ---: | ---: | ---: | ---: |"]  # fmt: skip
    by = {(p["path"], p["streams"]): p for p in phases if p.get("upstream", "http") == "http"}
    for (path, streams), p in sorted(by.items(), key=lambda kv: kv[0][1]):
        if path != "llmtap" or ("litellm", streams) not in by:
            continue
        lt, ll = p["added_ttft_ms_p50"], by[("litellm", streams)]["added_ttft_ms_p50"]
        ratio = ll / lt if lt and ll and lt > 0 else None
        lines.append(f"| {streams} | {_f(lt)} | {_f(ll)} | {_f(ratio, 1)} |")
    return lines


def _ramp(results: dict[str, Any]) -> list[str]:
    lines = ["| streams | chunks/s | llmtap CPU (share of its core) | added gap p99 (ms) | added TTFT p99 (ms) | "
             "merged | upstream late p99 (ms) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for p in results.get("ramp", []):
        share = p["cpu_s"] / p["seconds"] if p.get("cpu_s") is not None and p["seconds"] else None
        lines.append(
            f"| {p['streams']} | {_f(p['chunks_per_s'], 0)} | {_f(share)} | {_f(p['added_gap_ms_p99'])} | "
            f"{_f(p['added_ttft_ms_p99'])} | {merged(p)} | {_f(p['upstream_late_ms_p99'])} |"
        )
    cross = results.get("ramp_crossing_chunks_per_s")
    lines.append("")
    if cross is None:
        lines.append("llmtap's added gap p99 stayed at or under 5 ms over the whole ramp.")
    else:
        lines.append(f"llmtap's added gap p99 passes 5 ms at about **{cross:.0f} chunks/s** on its one core.")
    return lines


def _bucket(bounds: list[float] | None) -> str:
    return _f(None) if not bounds else f"{_f(bounds[0])} to {_f(bounds[1])}"


def _accuracy(acc: dict[str, Any]) -> list[str]:
    lines = [
        f"aiperf {acc.get('aiperf_version')} at concurrency {acc['concurrency']}: {acc['aiperf_requests']} requests "
        f"profiled; llmtap saw {acc['llmtap_requests_all']} (warm-up included), {acc['llmtap_requests_profiled']} "
        f"in aiperf's profiling window; Prometheus counted {_f(acc['prometheus_count'], 0)}.",
        "",
        "| TTFT | aiperf (ms) | llmtap exact (ms) | diff (ms) | allowed (ms) | ok | llmtap exact, all (ms) | "
        "Prometheus histogram_quantile (ms) | its bucket (ms) | error | ok (≤ 5%) |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in acc["ttft"]:
        lines.append(
            f"| p{r['quantile']} | {_f(r['aiperf_ms'])} | {_f(r['llmtap_exact_ms'])} | {_f(r['diff_ms'])} | "
            f"{_f(r['allowed_ms'])} | {'yes' if r['ok_vs_aiperf'] else 'NO'} | {_f(r['llmtap_exact_all_ms'])} | "
            f"{_f(r['prometheus_ms'])} | {_bucket(r.get('hist_bucket_ms'))} | {_f(r['hist_error_pct'], 1)}% | "
            f"{'yes' if r['ok_hist'] else 'NO'} |"
        )
    lines += [
        "",
        f"ITL p50: aiperf {_f(acc['itl_p50_ms']['aiperf'])} ms, llmtap TPOT {_f(acc['itl_p50_ms']['llmtap_tpot'])} ms; "
        f"p99: aiperf {_f(acc['itl_p99_ms']['aiperf'])} ms, llmtap {_f(acc['itl_p99_ms']['llmtap_tpot'])} ms.",
    ]
    return lines


def _workers(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| workers | streams | added TTFT p50 / p99 (ms) | added gap p99 (ms) | merged | CPU s per 1000 chunks | "
             "RSS idle (MiB) | /metrics scrape p50 (ms) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['streams']} | {_f(r['added_ttft_ms_p50'])} / {_f(r['added_ttft_ms_p99'])} | "
            f"{_f(r['added_gap_ms_p99'])} | {merged(r)} | {_f(r['cpu_s_per_1000_chunks'], 3)} | "
            f"{_f(r['rss_idle_mib'], 1)} | {_f(r['scrape_ms_p50'], 1)} |"
        )
    return lines


def markdown(results: dict[str, Any]) -> str:
    """The figures of a run as Markdown."""
    m = results["machine"]
    lines = [
        f"Command: `{results.get('command', 'python -m bench')}` (each figure's own: `command` in results.json).",
        f"Run: {results['started']} ({results['mode']}), network namespace: {'yes' if results['netns'] else 'no'}, "
        f"niceness {results.get('nice', 0)}.",
        f"Machine: {m['cpu']}, {m['cores']} cores, Linux {m['kernel']}, Python {m['python']}; "
        f"{m['nginx']}; LiteLLM {m['litellm']}; aiperf {m['aiperf']}; {m['prometheus']}.",
        f"Libraries: {', '.join(f'{k} {v}' for k, v in m['versions'].items())}.",
        f"Load before: `{results['load_before']}`; after: `{results.get('load_after', '')}`.",
    ]
    check = results.get("client_check")
    if check:
        figures = (
            f"direct path, {check['requests']} staggered requests pooled: added TTFT p50 "
            f"{_f(check['added_ttft_ms_p50'])} ms, gap p50 {_f(check['added_gap_ms_p50'])} ms, "
            f"{check['merged']} merged"
        )
        if check["ok"]:
            lines.append(f"Load client kept up ({figures}; within {check['limit_ms']:g} ms).")
        else:
            lines.append(
                f"**Load client lagged** ({figures}; over {check['limit_ms']:g} ms or merged): the machine was "
                "busy, and every path's added figures include the client's own delay."
            )
    for skip in results.get("skipped", []):
        lines.append(f"Not run: {skip['path']} over {skip['upstream']} ({skip['why']}).")
    if results.get("upstream_ca"):
        lines.append(f"llmtap trusted the run's CA through: {results['upstream_ca']}.")
    if results["phases"]:
        lines += ["", "### Paths side by side", "", *_phases_table(results["phases"])]
        ratios = _ratios(results["phases"])
        if len(ratios) > 2:
            lines += ["", "### Added TTFT, llmtap against LiteLLM", "", *ratios]
    if results.get("bursts"):
        plan = results.get("plan", {})
        if plan.get("bursts_in_turn"):
            spread = (
                "taken in turn across the paths (the first burst of each path, then the second of each, and so on; "
                "each burst alone on the proxy's core, once the path before it has drained its telemetry)"
            )
        else:
            spread = f"{plan.get('burst_period_s', 0):.2f} s apart"
        lines += [
            "",
            "### Burst arrivals (new connections, released at once)",
            "",
            f"Medians over {plan.get('bursts_per_size', '?')} bursts per size, {spread}, "
            "of each burst's own percentiles; merged and errors summed over the bursts. Added TTFT starts "
            "before the client's connect, so it holds the connect (and, direct over https, a TLS handshake per "
            "request, where a proxy reuses its pooled upstream connections): the connect column is that part.",
            "",
            *_bursts_table(results["bursts"]),
        ]
    if any(r.get("cpu_s") is not None for r in [*results["phases"], *results.get("bursts", [])]):
        lines += [
            "",
            "### CPU per 1,000 chunks by process, and memory per open stream",
            "",
            "Relay: every process of the path's tree but llmtap's telemetry process (`/proc/PID/comm` "
            "`llmtap-telemetr`); nginx's whole tree is its relay. RSS: relay processes with every stream of "
            "the phase (or burst) open, less idle, per stream. Tapes dropped: `llmtap_telemetry_tapes_dropped_total` "
            "over the phase, n/a when llmtap does not export it.",
            "",
            *_cpu_table(results),
        ]
    one_core = _one_core_table(results)
    if one_core:
        lines += [
            "",
            "### The one-core budget: llmtap against nginx, each on one core",
            "",
            "`llmtap:one-core`: llmtap's whole process tree (relay and telemetry) pinned to the one core nginx's "
            "worker has; `llmtap`: its relay alone there, its telemetry process on the client's core. Targets"
            ": added TTFT p50 within nginx's + 3 ms and p99 within + 10 ms, gap p99 within + 2 ms, "
            "0 merged; relay 25 µs and telemetry 30 µs of CPU per chunk. Merged: by the path, then (+N by the "
            "upstream) pairs the upstream itself wrote less than half a gap apart, late on its busy core (with "
            "`llmtap`, the telemetry process shares that core): no path keeps those apart.",
            "",
            *one_core,
        ]
    if results.get("ramp"):
        lines += ["", "### llmtap's ramp (50 chunks/s per stream)", "", *_ramp(results)]
    if results.get("workers"):
        lines += ["", "### Scale-out: llmtap --workers, both cores free to it", "", *_workers(results["workers"])]
    if results.get("accuracy"):
        lines += ["", "### Accuracy", "", *_accuracy(results["accuracy"])]
    return "\n".join(lines) + "\n"


def write_results(results: dict[str, Any], path: Path) -> None:
    """Replace the figures block of RESULTS.md with this run's tables."""
    text = path.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END)
    path.write_text(text[: start + len(BEGIN)] + "\n" + markdown(results) + text[end:], encoding="utf-8")
