"""The ``llmtap`` command: ``serve``, ``simulate``, ``demo``, ``compare`` and ``slo``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from proxy import __version__
from proxy.settings import CHUNK_SPAN_MODES, HISTOGRAM_BUCKETS, SPAN_ROLES, UPSTREAM_CLIENTS, ConfigError, build


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the tracing proxy in front of an LLM API")
    p.add_argument("--upstream", help="upstream base URL, e.g. https://api.openai.com (env LLMTAP_UPSTREAM)")
    p.add_argument("--provider", help="gen_ai.provider.name to report, e.g. openai, anthropic, vllm")
    p.add_argument("--config", help="YAML file with routes and settings (env LLMTAP_CONFIG)")
    p.add_argument("--host", help="proxy listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="proxy listen port (default 8080)")
    p.add_argument("--admin-host", dest="admin_host", help="admin listen address (default 127.0.0.1)")
    p.add_argument(
        "--admin-port", dest="admin_port", type=int, help="admin port for /metrics, /healthz, /readyz (default 9464)"
    )
    p.add_argument(
        "--chunk-spans", dest="chunk_spans", choices=CHUNK_SPAN_MODES, help="one span per decode chunk, events, or off"
    )
    p.add_argument(
        "--histogram-buckets",
        dest="histogram_buckets",
        choices=HISTOGRAM_BUCKETS,
        help="gen_ai.* histogram buckets: the conventions' (standard, default) or llmtap's fine ones",
    )
    p.add_argument(
        "--server-metrics",
        dest="server_metrics",
        action="store_const",
        const=True,
        help="also emit gen_ai.server.* (the model server's metric names; llmtap's values include its hop)",
    )
    p.add_argument(
        "--span-role",
        dest="span_role",
        choices=SPAN_ROLES,
        help="the proxy span: the GenAI generation, or the HTTP hop under a traced client's own (default auto: "
        "the hop when a traceparent arrives)",
    )
    p.add_argument(
        "--offline-token-usage",
        dest="offline_token_usage",
        action="store_true",
        default=None,
        help="report tiktoken's counts as gen_ai.usage.* when the upstream reports no usage",
    )
    p.add_argument("--connect-timeout", dest="connect_timeout", type=float, help="upstream connect timeout, seconds")
    p.add_argument(
        "--read-timeout", dest="read_timeout", type=float, help="longest wait for upstream response headers, seconds"
    )
    p.add_argument(
        "--idle-timeout", dest="idle_timeout", type=float, help="longest silence between two chunks (default: read)"
    )
    p.add_argument(
        "--drain-timeout", dest="drain_timeout", type=float, help="on SIGTERM, how long streams may finish (30)"
    )
    p.add_argument(
        "--flush-timeout", dest="flush_timeout", type=float, help="on exit, how long telemetry may take to flush (5)"
    )
    c = p.add_argument_group("clients: slow or idle connections and how many (timeouts in seconds)")
    c.add_argument(
        "--client-header-timeout",
        dest="client_header_timeout",
        type=float,
        help="a request's line and headers must all arrive this soon after its first byte, else 408 (20)",
    )
    c.add_argument(
        "--client-body-timeout",
        dest="client_body_timeout",
        type=float,
        help="longest silence while a request body is arriving; past it 408 and the request is dropped (60)",
    )
    c.add_argument(
        "--keep-alive-timeout",
        dest="keep_alive_timeout",
        type=float,
        help="a connection without a request in progress is closed after this (75)",
    )
    c.add_argument(
        "--max-client-connections",
        dest="max_client_connections",
        type=int,
        help="client connections open at once per relay; past it 503 (default: from the descriptor limit, <= 4096)",
    )
    p.add_argument("--max-request-bytes", dest="max_request_bytes", type=int, help="largest request body (64 MiB)")
    p.add_argument(
        "--max-header-bytes", dest="max_header_bytes", type=int, help="largest request line plus headers (64 KiB)"
    )
    p.add_argument(
        "--stream-buffer-bytes",
        dest="stream_buffer_bytes",
        type=int,
        help="receive buffer per upstream connection, what a slow client can make a stream hold (128 KiB; 0: kernel)",
    )
    p.add_argument(
        "--upstream-client",
        dest="upstream_client",
        choices=UPSTREAM_CLIENTS,
        help="client for upstreams: llmtap's own HTTP/1.1 one, or httpx's (lean)",
    )
    t = p.add_argument_group("HTTPS upstream (per route as tls_* keys in --config)")
    t.add_argument(
        "--upstream-ca",
        dest="upstream_ca",
        metavar="FILE",
        help="CA bundle to verify the upstream with instead of the default roots (env LLMTAP_UPSTREAM_CA)",
    )
    t.add_argument(
        "--upstream-ca-dir", dest="upstream_ca_dir", metavar="DIR", help="directory of hashed CA certificates"
    )
    t.add_argument(
        "--upstream-cert",
        dest="upstream_cert",
        metavar="FILE",
        help="client certificate for mutual TLS, PEM; may hold its key too (env LLMTAP_UPSTREAM_CERT)",
    )
    t.add_argument("--upstream-key", dest="upstream_key", metavar="FILE", help="the client certificate's key, PEM")
    t.add_argument(
        "--upstream-server-name",
        dest="upstream_server_name",
        metavar="NAME",
        help="name sent as SNI and verified in the certificate, when not the URL's host",
    )
    t.add_argument(
        "--upstream-insecure",
        dest="upstream_insecure",
        action="store_const",
        const=True,
        help="do not verify the upstream's certificate at all (logged as a warning)",
    )
    p.add_argument("--slo-ttft-ms", dest="slo_ttft_ms", type=float, help="TTFT objective for goodput, ms")
    p.add_argument("--slo-tpot-ms", dest="slo_tpot_ms", type=float, help="TPOT objective for goodput, ms")
    p.add_argument("--slo-e2e-ms", dest="slo_e2e_ms", type=float, help="end-to-end objective for goodput, ms")
    p.add_argument(
        "--no-inject-usage",
        dest="inject_usage",
        action="store_const",
        const=False,
        help="never add stream_options.include_usage to OpenAI streams",
    )
    p.add_argument("--log-level", dest="log_level", choices=("debug", "info", "warning", "error"))
    p.add_argument("--workers", type=int, help="relay processes sharing the port, one per core (1)")
    p.add_argument(
        "--telemetry-workers",
        dest="telemetry_workers",
        type=int,
        help="telemetry processes, upstreams spread over them; /metrics merges them (1; env LLMTAP_TELEMETRY_WORKERS)",
    )
    q = p.add_argument_group("admission queue and queue/prefill estimates (per route in --config)")
    q.add_argument(
        "--max-concurrency", dest="max_concurrency", type=int, help="requests in flight to an upstream at most"
    )
    q.add_argument("--queue-limit", dest="queue_limit", type=int, help="requests waiting in line at most (100)")
    q.add_argument("--queue-timeout", dest="queue_timeout", type=float, help="longest wait in line, seconds")
    q.add_argument(
        "--queue-full-status", dest="queue_full_status", type=int, choices=(429, 503), help="status when full (503)"
    )
    q.add_argument("--retry-after", dest="retry_after", type=int, help="Retry-After seconds when full (1)")
    q.add_argument(
        "--server-slots",
        dest="server_slots",
        type=int,
        help="sequences the upstream runs at once (vLLM --max-num-seqs), to infer its queueing",
    )
    q.add_argument(
        "--prefill-rate", dest="prefill_rate", type=float, help="upstream prefill rate, input tokens/s (else learned)"
    )
    r = p.add_argument_group("request records and prompt caching (see llmtap compare)")
    r.add_argument("--record", metavar="PATH", help="write one JSON line per request to PATH (env LLMTAP_RECORD)")
    r.add_argument("--record-max-mb", dest="record_max_mb", type=float, help="start a new record file past this (64)")
    r.add_argument("--record-files", dest="record_files", type=int, help="record files kept on disk at most (5)")
    r.add_argument(
        "--prompt-version",
        dest="prompt_version",
        help="prompt version of requests without an x-llmtap-prompt-version header",
    )
    r.add_argument(
        "--cache-min-tokens",
        dest="cache_min_tokens",
        type=int,
        help="shortest prompt the upstream caches (default 16 for self-hosted servers, 1024 for hosted APIs)",
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default after its help; descriptions and tables keep their own line breaks."""


class _ProfilesAction(argparse.Action):
    """``--help`` or ``--list-profiles`` of simulate: the profile table, read only when asked for.

    The table lives with the profiles in ``proxy.simulator``, which loads the tokenizer: ``llmtap serve``
    must not pay for it (nor the relay load it), so it is imported here and not when the parser is built.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from proxy.simulator.profiles import profile_table

        table = f"profiles (--profile NAME):\n{profile_table()}\n"
        if "--list-profiles" in self.option_strings:
            sys.stdout.write(table)
        else:
            parser.epilog = table
            parser.print_help()
        parser.exit()


def _simulate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate",
        help="run the simulated LLM server (an offline upstream)",
        description=(
            "A simulated LLM server: OpenAI Chat Completions, Completions and Responses, Anthropic Messages,\n"
            "Ollama (/api/chat, /api/generate) and Gemini (:generateContent, :streamGenerateContent), timed\n"
            "by a continuous-batching scheduler with a prefix cache. Its own truth per request is at\n"
            "GET /debug/requests, its counters at GET /metrics."
        ),
        formatter_class=_HelpFormatter,
        add_help=False,
    )
    p.add_argument("-h", "--help", action=_ProfilesAction, help="show this help and the profiles, then exit")
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=8000, help="listen port")
    p.add_argument("--profile", default="support", metavar="NAME", help="timing and capacity profile, listed below")
    p.add_argument("--list-profiles", action=_ProfilesAction, help="print the profiles and what each models, then exit")


def _demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo", help="offline: a simulated server behind the proxy; prints TTFT, ITL, throughput, goodput"
    )
    p.add_argument("--requests", type=int, help="requests per workload and layout (default 8 support, 16 code)")
    p.add_argument("--concurrency", type=int, help="concurrent streams (default 4)")
    p.add_argument(
        "--output-tokens",
        dest="output_tokens",
        type=int,
        help="output tokens per request (default 300 support, 64 code)",
    )
    p.add_argument("--workload", choices=("support", "code"), help="run one workload only (default both)")
    p.add_argument(
        "--slo-ttft-ms",
        dest="slo_ttft_ms",
        type=float,
        help="TTFT objective for goodput, ms (default 500 support, 100 code)",
    )
    p.add_argument(
        "--slo-tpot-ms",
        dest="slo_tpot_ms",
        type=float,
        help="TPOT objective for goodput, ms (default 30 support, 15 code)",
    )
    p.add_argument(
        "--min-gain-ms", dest="min_gain_ms", type=float, help="least TTFT p50 gain the verdict counts, ms (100)"
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument(
        "--serve", action="store_true", help="keep the proxy running after the tables and print the live view's URL"
    )


def _compare_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "compare",
        help="before against after a prompt change: TTFT percentiles with CIs, cached share, cache classes",
    )
    p.add_argument("records", nargs="?", help="a record file written by serve --record (rotated siblings included)")
    p.add_argument("--prometheus", metavar="URL", help="read the proxy's metrics from this Prometheus server instead")
    p.add_argument("--before", metavar="V1", help="prompt version before the change")
    p.add_argument("--after", metavar="V2", help="prompt version after the change")
    p.add_argument("--split-at", dest="split_at", metavar="TIME", help="split at this ISO 8601 time instead")
    p.add_argument("--window", metavar="DURATION", help="only this long (each side for --split-at), e.g. 1h")
    p.add_argument("--until", metavar="TIME", help="the end of the window (default now)")
    p.add_argument("--route", help="only requests of this route")
    p.add_argument("--model", help="only requests for this model")
    p.add_argument("--shape", help="only requests of this shape (llmtap.request.shape)")
    p.add_argument("--config", metavar="FILE", help="judge each side's SLOs by this config's objectives")
    p.add_argument("--min-gain-ms", dest="min_gain_ms", type=float, help="least TTFT p50 gain that counts (100)")
    p.add_argument("--min-requests", dest="min_requests", type=int, help="least requests with a TTFT a side (3)")
    p.add_argument("--resamples", type=int, help="bootstrap resamples (2000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed, for repeatable intervals (0)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the TTFT distributions and cached shares (matplotlib)")


def _slo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "slo",
        help="each route and request shape against its objective: the percentile that counts, with its CI",
    )
    p.add_argument("records", nargs="?", help="a record file written by serve --record (rotated siblings included)")
    p.add_argument("--prometheus", metavar="URL", help="read the proxy's metrics from this Prometheus server instead")
    p.add_argument(
        "--config",
        metavar="FILE",
        help="judge by this config's objectives (routes[].slo); needed with --prometheus",
    )
    p.add_argument("--window", metavar="DURATION", help="only the requests of this long before --until, e.g. 1h")
    p.add_argument("--until", metavar="TIME", help="the end of the window (default now)")
    p.add_argument("--route", help="only requests of this route")
    p.add_argument("--shape", help="only requests of this shape")
    p.add_argument("--resamples", type=int, help="bootstrap resamples (2000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed, for repeatable intervals (0)")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.add_argument("--check", action="store_true", help="exit 1 when any objective is missed")


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``llmtap`` command."""
    p = argparse.ArgumentParser(prog="llmtap", description="OpenTelemetry tracing proxy for LLM inference.")
    p.add_argument("--version", action="version", version=f"llmtap {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _simulate_parser(sub)
    _demo_parser(sub)
    _compare_parser(sub)
    _slo_parser(sub)
    return p


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every upstream request's full URL at INFO (API keys in the query, Gemini's ?key=, included)
    # and httpcore logs response headers at DEBUG: neither may reach llmtap's log, at any level.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for a bad configuration)."""
    args = parser().parse_args(argv)
    try:
        if args.command == "serve":
            settings = build(vars(args))
            _logging(settings.log_level)
            from proxy.relay.server import run

            run(settings)
        elif args.command == "simulate":
            _logging("info")
            from proxy import simulator

            profile = simulator.PROFILES.get(args.profile)
            if profile is None:
                raise ConfigError(f"unknown profile {args.profile!r}; known: {', '.join(sorted(simulator.PROFILES))}")
            asyncio.run(simulator.serve(args.host, args.port, profile))
        elif args.command == "demo":
            logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
            from proxy import demo

            return demo.main(args)
        elif args.command == "compare":
            from proxy.analysis import compare

            return compare.main(args)
        elif args.command == "slo":
            from proxy.analysis import slo

            return slo.main(args)
    except ConfigError as exc:
        print(f"llmtap: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
