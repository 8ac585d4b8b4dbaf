"""The option table (``llmtap.config.options``) against what is made of it: ``llmtap serve --help``, the settings
``build`` reads, the file's keys and schema, and ``docs/settings.md``; errors through the real command line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from llmtap.config import options
from llmtap.config.load import build
from llmtap.config.options import OPTIONS, ROUTE_OPTIONS, Option
from llmtap.config.types import ConfigError
from tests.commands.test_cli import ROOT, assert_config_error, clean_env
from tests.support.generators import load

UP = "http://127.0.0.1:9"
settings_doc = load("settings")
#: Kinds that take any text: no value is wrong for them.
ANY_TEXT = {"a non-empty text", "a file name"}


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m llmtap serve ARGS`` to completion, with ``env`` over a clean environment."""
    return subprocess.run(
        [sys.executable, "-m", "llmtap", "serve", *args],
        cwd=ROOT,
        env=clean_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_settings_page_and_schema_are_current() -> None:
    run = subprocess.run(
        [sys.executable, "docs/generate/settings.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_check_fails_when_the_page_is_stale(tmp_path: Path) -> None:
    said: list[str] = []
    assert settings_doc.main(["--docs", str(tmp_path)], write=said.append) == 0
    assert settings_doc.main(["--check", "--docs", str(tmp_path)], write=said.append) == 0
    page = tmp_path / "settings.md"
    page.write_text(page.read_text(encoding="utf-8").replace("LLMTAP_PORT", "LLMTAP_PROT", 1), encoding="utf-8")
    assert settings_doc.main(["--check", "--docs", str(tmp_path)], write=said.append) == 1
    assert "settings.md is stale" in said[-1]


def test_the_page_lists_every_option() -> None:
    text = settings_doc.page()
    for o in OPTIONS.values():
        for name in (o.flag, o.env, o.key):
            if name is not None:
                assert f"`{name}`" in text, name
    for key in ROUTE_OPTIONS:
        assert f"| `{key}` |" in text, key


def test_help_lists_every_flag_with_its_variable_and_default() -> None:
    result = serve("--help-all", env={"COLUMNS": "1000"})  # argparse wraps at hyphens too: not here
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    flagged = [o for o in OPTIONS.values() if o.flag is not None]
    assert len(flagged) >= 50
    # Each flag's entry runs from "  --flag METAVAR" to the next flag's entry, in the table's order.
    starts = []
    for o in flagged:
        assert o.flag is not None
        shown = o.flag if o.switch is not None else f"{o.flag} {o.kind.metavar}"
        found = re.search(rf"(?<![\w\[-]){re.escape(shown)}(?![\w\]-])", text)
        assert found is not None, o.flag
        starts.append(found.start())
    assert starts == sorted(starts)
    for o, start, end in zip(flagged, starts, [*starts[1:], len(text)], strict=True):
        entry = text[start:end]
        assert o.help.split()[0] in entry, (o.flag, entry)
        if o.env is not None:
            assert f"env {o.env}" in entry, (o.flag, entry)
        assert f"default {' '.join(o.shown_default().split())}" in entry, (o.flag, entry)
    # Nothing in --help that the table does not have.
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", text)) - {"--help", "--help-all", "--config", "--upstream"}
    assert flags <= {o.flag for o in flagged} | {"--max-num-seqs", "--idle-timeout", "--upstream-insecure"}


def _bad(o: Option) -> object:
    """A value ``o`` refuses."""
    if o.kind.expected.startswith(("an integer", "0 (the kernel's)")):
        return -5
    if o.kind.expected.startswith("a number"):
        return "soon"
    if o.kind.expected == "a list of model names" or o.name == "prompt_version":
        return "a\x01b"
    return "☃ not this"


CHECKED = [o for o in OPTIONS.values() if o.kind.expected not in ANY_TEXT and o.group != "route"]


@pytest.mark.parametrize("o", [o for o in CHECKED if o.env is not None], ids=lambda o: o.name)
def test_every_variable_is_read_and_checked(o: Option) -> None:
    assert o.env is not None
    with pytest.raises(ConfigError) as info:
        build({} if o.name == "upstream" else {"upstream": UP}, env={o.env: str(_bad(o))})
    assert str(info.value).startswith(f"{o.env}="), str(info.value)


@pytest.mark.parametrize("o", [o for o in CHECKED if o.flag is not None and o.switch is None], ids=lambda o: o.name)
def test_every_flag_is_read_and_checked(o: Option) -> None:
    with pytest.raises(ConfigError) as info:
        build({"upstream": UP, o.name: str(_bad(o))}, env={})
    assert str(info.value).startswith(f"{o.flag} "), str(info.value)


def _nested(key: str, value: object) -> dict[str, object]:
    section, _, sub = key.partition(".")
    return {section: {sub: value}} if sub else {section: value}


@pytest.mark.parametrize("o", [o for o in CHECKED if o.key is not None], ids=lambda o: o.name)
def test_every_file_key_is_read_and_checked(o: Option, tmp_path: Path) -> None:
    assert o.key is not None
    path = tmp_path / "llmtap.yaml"
    bad = _bad(o)
    path.write_text(yaml.safe_dump(_nested(o.key, bad)), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        build({"config": str(path)} if o.name == "upstream" else {"upstream": UP, "config": str(path)}, env={})
    assert str(info.value).startswith(f"{path}: {o.key}: "), str(info.value)
    # The schema refuses it too, and takes the default.
    schema = options.json_schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_nested(o.key, bad), schema)
    if o.default is not None:
        jsonschema.validate(_nested(o.key, list(o.default) if isinstance(o.default, tuple) else o.default), schema)


def test_a_file_of_every_default_builds_the_defaults(tmp_path: Path) -> None:
    data: dict[str, dict[str, object] | object] = {}
    for o in OPTIONS.values():
        if o.key is None or o.default is None or o.name == "tls_verify":  # TLS keys need an https:// route
            continue
        value = list(o.default) if isinstance(o.default, tuple) else o.default
        section, _, sub = o.key.partition(".")
        if sub:
            box = data.setdefault(section, {})
            assert isinstance(box, dict)
            box[sub] = value
        else:
            data[section] = value
    data["routes"] = [{"prefix": "/a", "upstream": "http://a.example", "queue_limit": 7}]
    jsonschema.validate(data, options.json_schema())
    path = tmp_path / "llmtap.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    from_file = build({"upstream": UP, "config": str(path)}, env={})
    plain = build({"upstream": UP}, env={})
    by_prefix = {r.prefix: r for r in from_file.routes}
    assert by_prefix["/a"].queue_limit == 7 and by_prefix["/"] == plain.routes[0]
    assert from_file.telemetry == plain.telemetry and from_file.timeouts == plain.timeouts
    assert (from_file.port, from_file.record, from_file.max_request_bytes) == (8080, plain.record, 64 << 20)


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (("--port", "abc"), {}, "llmtap: error: --port abc: expected an integer from 0 to 65535"),
        ((), {"LLMTAP_PORT": "abc"}, "llmtap: error: LLMTAP_PORT=abc: expected an integer from 0 to 65535"),
        (("--slo-ttft-ms", "-5"), {}, "llmtap: error: --slo-ttft-ms -5: expected a number of milliseconds >= 0"),
        (
            (),
            {"LLMTAP_CHUNK_SPANS": "all"},
            "llmtap: error: LLMTAP_CHUNK_SPANS=all: expected one of spans, events, off",
        ),
        (("--queue-full-status", "404"), {}, "llmtap: error: --queue-full-status 404: expected one of 429, 503"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_source(args: tuple[str, ...], env: dict[str, str], line: str) -> None:
    result = serve("--upstream", UP, *args, env=env)
    assert_config_error(result, line)
    assert result.stderr == line + "\n"


def test_a_bad_file_value_names_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "llmtap.yaml"
    path.write_text("slo: {ttft_ms: -5}\n", encoding="utf-8")
    result = serve("--upstream", UP, "--config", str(path))
    assert_config_error(result, f"{path}: slo.ttft_ms: expected a number of milliseconds >= 0, got -5")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("listen: {prot: 1}\n", "unknown key 'listen.prot'; did you mean 'listen.port'?"),
        ("slo: {ttft: 100}\n", "unknown key 'slo.ttft'; did you mean 'slo.ttft_ms'?"),
        ("listen_port: 1\n", "unknown key 'listen_port'; did you mean 'listen.port'?"),
        ("telemetri: {}\n", "unknown key 'telemetri'; did you mean 'telemetry'?"),
        (
            "routes:\n  - {prefix: /a, upstrem: 'http://a'}\n",
            "routes[0]: unknown key 'upstrem'; did you mean 'upstream'?",
        ),
    ],
)
def test_an_unknown_file_key_gets_a_did_you_mean(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "llmtap.yaml"
    path.write_text(text, encoding="utf-8")
    result = serve("--upstream", UP, "--config", str(path))
    assert_config_error(result, f"{path}: {needle}")


def test_an_unknown_flag_gets_a_did_you_mean_and_no_usage_block() -> None:
    result = serve("--upstream", UP, "--prot", "8081")
    assert result.returncode == 2
    assert result.stderr == "llmtap: error: unrecognized arguments: --prot 8081 (did you mean --port?)\n"
    result = serve("--upstream")
    assert result.returncode == 2
    assert result.stderr == "llmtap serve: error: argument --upstream: expected one argument\n"


def test_the_ports_are_checked_before_the_upstream() -> None:
    assert_config_error(serve("--upstream", "localhost:1", "--port", "x"), "--port x: ")
