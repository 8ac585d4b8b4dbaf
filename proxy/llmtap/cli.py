"""The ``llmtap`` command: ``serve``, ``simulate``, ``demo``, ``compare``, ``slo`` and ``docs``."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from llmtap import __version__, logs
from llmtap.config import options
from llmtap.config.load import build
from llmtap.config.options import GROUPS, OPTIONS, Option, by_group
from llmtap.config.types import ConfigError
from llmtap.store import ENGINES

if TYPE_CHECKING:
    from llmtap.simulator.faults import FaultPlan

__all__ = ["main", "parser"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, exit code 2, with a "did you mean" for an unknown flag."""

    def error(self, message: str) -> NoReturn:
        """``llmtap serve: error: unrecognized arguments: --prot (did you mean --port?)``, not the usage block."""
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown is not None and unknown.group(1).startswith("--"):
            flag = unknown.group(1).split("=", 1)[0]
            close = difflib.get_close_matches(flag, self._flags(), n=1, cutoff=0.6)
            if flag in options.REMOVED:
                message += f" ({flag} was removed: {options.REMOVED[flag]})"
            elif close:
                message += f" (did you mean {close[0]}?)"
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _flags(self) -> list[str]:
        """Every flag of this parser and of its commands."""
        flags = [f for action in self._actions for f in action.option_strings if f.startswith("--")]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    flags += [f for a in sub._actions for f in a.option_strings if f.startswith("--")]
        return flags


def help_text(option: Option) -> str:
    """An option's line in ``llmtap serve --help``: what it does, its variable and its default."""
    where = [f"env {option.env}"] if option.env is not None else []
    if option.key is not None:
        where.append(f"file {option.key}")
    where.append(f"default {option.shown_default()}")
    # A flag that switches a setting off (``--no-prometheus``) says so: the table's words say what the setting does.
    what = f"do not {option.help}" if option.switch is False else option.help
    return f"{what} ({'; '.join(where)})".replace("%", "%%")


SERVE_DESCRIPTION = """\
Run the tracing proxy in front of an LLM API: llmtap serve --upstream https://api.openai.com

Every setting is a flag, an LLMTAP_* variable or a key in the --config file (routes: several upstreams);
flags win over variables, variables over the file. This help shows the settings most runs need;
--help-all shows every one (also `llmtap docs settings`)."""

#: The settings ``llmtap serve --help`` shows; ``--help-all`` shows every one.
SERVE_ESSENTIALS = frozenset(
    {
        "upstream",
        "provider",
        "config",
        "host",
        "port",
        "admin_host",
        "admin_port",
        "admin_token_file",
        "slo_ttft_ms",
        "slo_tpot_ms",
        "max_concurrency",
        "record",
        "prompt_version",
        "access_log",
        "log_level",
        "workers",
    }
)


class _HelpAllAction(argparse.Action):
    """``serve --help-all``: the help with every setting, the ones ``--help`` leaves out put back."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        for action in parser._actions:
            full = getattr(action, "full_help", None)
            if full is not None:
                action.help = full
        parser.print_help()
        parser.exit()


def _serve_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the tracing proxy in front of an LLM API",
        usage="llmtap serve [--upstream URL | --config FILE] [options]",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--help-all", action=_HelpAllAction, help="show every setting, then exit")
    for group, found in by_group(OPTIONS.values()).items():
        flagged = [o for o in found if o.flag is not None]
        if not flagged:
            continue
        g = p.add_argument_group(GROUPS[group])
        for o in flagged:
            assert o.flag is not None
            if o.switch is not None:
                action = g.add_argument(o.flag, dest=o.name, action="store_const", const=o.switch)
            else:
                # Taken as text: the value is checked with the variable's and the file's, and a bad one is
                # named in one line (``--port abc: expected ...``) rather than by argparse's usage block.
                action = g.add_argument(o.flag, dest=o.name, metavar=o.kind.metavar)
            # The short help leaves a setting out (a group with none left is left out whole); --help-all puts it back.
            action.full_help = help_text(o)  # type: ignore[attr-defined]
            action.help = action.full_help if o.name in SERVE_ESSENTIALS else argparse.SUPPRESS  # type: ignore[attr-defined]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default after its help; descriptions and tables keep their own line breaks."""


class _ProfilesAction(argparse.Action):
    """``--help`` or ``--list-profiles`` of simulate: the profile table, read only when asked for.

    The table lives with the profiles in ``llmtap.simulator``, which loads the tokenizer: ``llmtap serve``
    must not pay for it (nor the relay load it), so it is imported here and not when the parser is built.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from llmtap.simulator.profiles import profile_table

        table = f"profiles (--profile NAME):\n{profile_table()}\n"
        if "--list-profiles" in self.option_strings:
            sys.stdout.write(table)
        else:
            parser.epilog = table
            parser.print_help()
        parser.exit()


def _simulate_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
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
    p.add_argument(
        "--fault",
        metavar="SPEC",
        help="a fault to play on --fault-rate of requests: status=503, cut-after=N (chunks), first-byte-delay=S, "
        "terms joined by ';' (a request asks for its own with the x-sim-fault header)",
    )
    p.add_argument("--fault-rate", type=float, default=0.0, metavar="P", help="share of requests --fault is played on")
    p.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="export each request's span as vLLM does (llm_request, gen_ai.latency.*) over OTLP/HTTP protobuf to URL "
        "(/v1/traces added when it names no path), e.g. llmtap's admin listener",
    )


def _fault_plan(args: argparse.Namespace) -> FaultPlan:
    """``--fault`` and ``--fault-rate`` as the simulator's plan; ``ConfigError`` for a spec or rate it cannot use."""
    from llmtap.simulator.faults import FaultPlan, parse_fault
    from llmtap.simulator.requests import SimError

    try:
        fault = parse_fault(args.fault) if args.fault else None
        return FaultPlan(fault, args.fault_rate)
    except SimError as exc:
        raise ConfigError(f"--fault: {exc.message}") from None
    except ValueError as exc:
        raise ConfigError(f"--fault-rate: {exc}") from None


def _demo_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
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
        "--min-gain-ms",
        dest="min_gain_ms",
        type=float,
        help="least TTFT p50 gain the verdict counts, ms, besides a tenth of the before p50 (0)",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument(
        "--serve", action="store_true", help="keep the proxy running after the tables and print the live view's URL"
    )


def _record_sources(p: argparse.ArgumentParser) -> None:
    """Where ``compare`` and ``slo`` read requests from: record paths (by an engine), Prometheus or ClickHouse."""
    p.add_argument(
        "records",
        nargs="*",
        help="record folders written by serve --record, record files (older rotated siblings included), globs",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="what reads the records: the embedded engine (duckdb, pip install 'llmtap[analysis]') or plain Python, "
        "for small files (duckdb when installed, else python)",
    )
    p.add_argument("--prometheus", metavar="URL", help="read the proxy's metrics from this Prometheus server instead")
    p.add_argument(
        "--clickhouse",
        metavar="URL",
        help="read the records from ClickHouse's HTTP interface instead (user and password: the URL's, or "
        "LLMTAP_RECORD_CLICKHOUSE_USER / LLMTAP_RECORD_CLICKHOUSE_PASSWORD)",
    )
    p.add_argument(
        "--clickhouse-table", dest="clickhouse_table", default="llmtap_records", help="its table (llmtap_records)"
    )


def _compare_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "compare",
        help="before against after a prompt change: TTFT percentiles with CIs, cached share, cache classes",
    )
    _record_sources(p)
    p.add_argument("--before", metavar="V1", help="prompt version before the change")
    p.add_argument("--after", metavar="V2", help="prompt version after the change")
    p.add_argument("--split-at", dest="split_at", metavar="TIME", help="split at this ISO 8601 time instead")
    p.add_argument("--window", metavar="DURATION", help="only this long (each side for --split-at), e.g. 1h")
    p.add_argument("--until", metavar="TIME", help="the end of the window (default now)")
    p.add_argument("--route", help="only requests of this route")
    p.add_argument("--model", help="only requests for this model")
    p.add_argument("--shape", help="only requests of this shape (llmtap.request.shape)")
    p.add_argument("--config", metavar="FILE", help="judge each side's SLOs by this config's objectives")
    p.add_argument(
        "--min-gain-share",
        dest="min_gain_share",
        metavar="SHARE",
        help="least TTFT p50 change that counts, as a share of the before p50, e.g. 10%% or 0.1 (10%%)",
    )
    p.add_argument(
        "--min-gain-ms", dest="min_gain_ms", type=float, help="least TTFT p50 change that counts besides, in ms (0)"
    )
    p.add_argument("--min-requests", dest="min_requests", type=int, help="least requests with a TTFT a side (3)")
    p.add_argument("--resamples", type=int, help="bootstrap resamples (2000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed, for repeatable intervals (0)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the TTFT distributions and cached shares (matplotlib)")


def _docs_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("docs", help="list the documentation's pages, or print one (settings, reference, recipes, ...)")
    p.add_argument("page", nargs="?", metavar="NAME", help="the page to print; without it, the list")


def _slo_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "slo",
        help="each route and request shape against its objective: the percentile that counts, with its CI",
    )
    _record_sources(p)
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
    p.add_argument(
        "--rules",
        action="store_true",
        help="print Prometheus burn-rate alerting rules for the objectives (multi-window, multi-burn-rate) and exit; "
        "with --config, the objectives they will read are listed at the top",
    )
    p.add_argument(
        "--rules-selector",
        dest="rules_selector",
        default="",
        metavar="MATCHERS",
        help='label matchers of this deployment\'s series in the rules, e.g. job="llmtap" (none)',
    )
    p.add_argument(
        "--rules-by",
        dest="rules_by",
        default="",
        metavar="LABELS",
        help="labels the rules keep beside route and shape, e.g. namespace,job (one alert per deployment)",
    )


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``llmtap`` command."""
    p = _Parser(prog="llmtap", description="OpenTelemetry tracing proxy for LLM inference.")
    p.add_argument("--version", action="version", version=f"llmtap {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _serve_parser(sub)
    _simulate_parser(sub)
    _demo_parser(sub)
    _compare_parser(sub)
    _slo_parser(sub)
    _docs_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for a bad configuration)."""
    args = parser().parse_args(argv)
    try:
        if args.command == "serve":
            settings = build(vars(args))
            logs.setup(settings.log_level)
            from llmtap.relay import tls
            from llmtap.serve.run import run

            tls.check(settings.routes)  # a CA or certificate file that does not load: exit 2 now, not at a request

            run(settings)
        elif args.command == "simulate":
            logs.setup("info")
            from llmtap import simulator

            profile = simulator.PROFILES.get(args.profile)
            if profile is None:
                raise ConfigError(f"unknown profile {args.profile!r}; known: {', '.join(sorted(simulator.PROFILES))}")
            if args.otlp_traces_endpoint:
                from llmtap.simulator.spans import traces_url

                try:
                    traces_url(args.otlp_traces_endpoint)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
            plan = _fault_plan(args)
            asyncio.run(
                simulator.serve(
                    args.host, args.port, profile, faults=plan, otlp_traces_endpoint=args.otlp_traces_endpoint
                )
            )
        elif args.command == "demo":
            logs.setup("warning", stamp=False)
            from llmtap.commands import demo

            return demo.main(args)
        elif args.command == "compare":
            from llmtap.commands import compare

            return compare.main(args)
        elif args.command == "slo":
            from llmtap.commands import slo

            return slo.main(args)
        elif args.command == "docs":
            from llmtap.commands import manual

            sys.stdout.write(manual.read(args.page))
    except ConfigError as exc:
        print(f"llmtap: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
