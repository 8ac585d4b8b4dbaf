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


def _pct(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.0f}%"


def phase_line(fig: PathFigures) -> str:
    """A one-line progress report."""
    return (
        f"{fig.path:>8} x{fig.streams:<4} req {fig.requests:>4} fail {fig.failed} "
        f"ttft+ p50 {_f(fig.added_ttft_ms_p50)} p99 {_f(fig.added_ttft_ms_p99)} ms  "
        f"gap+ p50 {_f(fig.added_gap_ms_p50)} p99 {_f(fig.added_gap_ms_p99)} ms  merged {fig.merged}  "
        f"{fig.chunks_per_s:.0f} chunks/s  cpu/1k {_f(fig.cpu_s_per_1000_chunks, 3)} s "
        f"(kernel {_pct(fig.cpu_system_share)})  "
        f"rss/stream {_f(fig.rss_kib_per_stream, 1)} KiB"
    )


def _phases_table(phases: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| path | streams | requests (failed) | added TTFT p50 / p99 (ms) | added gap p50 / p99 (ms) | merged | "
        "chunks/s | CPU s per 1000 chunks (kernel share) | idle CPU (ms/s) | RSS per open stream (KiB) | "
        "upstream late p99 (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    order = {"direct": 0, "nginx": 1, "llmtap": 2, "litellm": 3}
    for p in sorted(phases, key=lambda p: (p["streams"], order.get(p["path"], 9))):
        lines.append(
            f"| {p['path']} | {p['streams']} | {p['requests']} ({p['failed']}) | "
            f"{_f(p['added_ttft_ms_p50'])} / {_f(p['added_ttft_ms_p99'])} | "
            f"{_f(p['added_gap_ms_p50'])} / {_f(p['added_gap_ms_p99'])} | {p['merged']} | "
            f"{_f(p['chunks_per_s'], 0)} | {_f(p['cpu_s_per_1000_chunks'], 3)} ({_pct(p.get('cpu_system_share'))}) | "
            f"{_f(p.get('idle_cpu_ms_per_s'), 1)} | {_f(p['rss_kib_per_stream'], 1)} | "
            f"{_f(p['upstream_late_ms_p99'])} |"
        )
    return lines


def _ratios(phases: list[dict[str, Any]]) -> list[str]:
    lines = ["| streams | llmtap added TTFT p50 (ms) | LiteLLM added TTFT p50 (ms) | ratio LiteLLM / llmtap |",
             "| ---: | ---: | ---: | ---: |"]  # fmt: skip
    by = {(p["path"], p["streams"]): p for p in phases}
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
            f"{_f(p['added_ttft_ms_p99'])} | {p['merged']} | {_f(p['upstream_late_ms_p99'])} |"
        )
    cross = results.get("ramp_crossing_chunks_per_s")
    lines.append("")
    if cross is None:
        lines.append("llmtap's added gap p99 stayed at or under 5 ms over the whole ramp.")
    else:
        lines.append(f"llmtap's added gap p99 passes 5 ms at about **{cross:.0f} chunks/s** on its one core.")
    return lines


def _accuracy(acc: dict[str, Any]) -> list[str]:
    lines = [
        f"aiperf {acc.get('aiperf_version')} at concurrency {acc['concurrency']}: {acc['aiperf_requests']} requests "
        f"profiled; llmtap saw {acc['llmtap_requests_all']} (warm-up included), {acc['llmtap_requests_profiled']} "
        f"in aiperf's profiling window; Prometheus counted {_f(acc['prometheus_count'], 0)}.",
        "",
        "| TTFT | aiperf (ms) | llmtap exact (ms) | diff (ms) | allowed (ms) | ok | llmtap exact, all (ms) | "
        "Prometheus histogram_quantile (ms) | error | ok (≤ 5%) |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for r in acc["ttft"]:
        lines.append(
            f"| p{r['quantile']} | {_f(r['aiperf_ms'])} | {_f(r['llmtap_exact_ms'])} | {_f(r['diff_ms'])} | "
            f"{_f(r['allowed_ms'])} | {'yes' if r['ok_vs_aiperf'] else 'NO'} | {_f(r['llmtap_exact_all_ms'])} | "
            f"{_f(r['prometheus_ms'])} | {_f(r['hist_error_pct'], 1)}% | {'yes' if r['ok_hist'] else 'NO'} |"
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
            f"{_f(r['added_gap_ms_p99'])} | {r['merged']} | {_f(r['cpu_s_per_1000_chunks'], 3)} | "
            f"{_f(r['rss_idle_mib'], 1)} | {_f(r['scrape_ms_p50'], 1)} |"
        )
    return lines


def markdown(results: dict[str, Any]) -> str:
    """The figures of a run as Markdown."""
    m = results["machine"]
    lines = [
        f"Run: {results['started']} ({results['mode']}), network namespace: {'yes' if results['netns'] else 'no'}, "
        f"niceness {results.get('nice', 0)}.",
        f"Machine: {m['cpu']}, {m['cores']} cores, Linux {m['kernel']}, Python {m['python']}; "
        f"{m['nginx']}; LiteLLM {m['litellm']}; aiperf {m['aiperf']}; {m['prometheus']}.",
        f"Libraries: {', '.join(f'{k} {v}' for k, v in m['versions'].items())}.",
        f"Load before: `{results['load_before']}`; after: `{results.get('load_after', '')}`.",
        "",
        "### Paths side by side",
        "",
        *_phases_table(results["phases"]),
        "",
        "### Added TTFT, llmtap against LiteLLM",
        "",
        *_ratios(results["phases"]),
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
