"""Attribution, cost and embeddings as pure units: bounding what callers send, pricing, fingerprints, parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtap.analysis.attribution import MAX_PROPERTIES, VALUE_CAP, dimensions, record_part
from llmtap.analysis.cost import (
    LOCAL,
    NO_USAGE,
    PRICED,
    PROVIDER,
    UNKNOWN_MODEL,
    PriceTable,
    header_cost,
    normalize,
    request_cost,
)
from llmtap.analysis.summary import Summary
from llmtap.analysis.timeline import Timeline
from llmtap.config.kinds import Invalid, dimension_names
from llmtap.config.prices import PriceError
from llmtap.providers import provider_for
from llmtap.providers.anthropic import AnthropicMessages
from llmtap.providers.embeddings import OllamaEmbed, OpenAIEmbeddings
from llmtap.providers.openai_chat import OpenAIChat
from llmtap.providers.sse import Event
from llmtap.relay.fingerprint import FINGERPRINT_CHARS, fingerprint, install_secret
from llmtap.relay.forward import request_headers
from llmtap.telemetry import semconv as sc

# --- attribution ---------------------------------------------------------------------------------


def test_headers_and_body_give_the_dimensions() -> None:
    dims, dropped = dimensions(
        [
            (b"x-llmtap-tenant", b" acme "),
            (b"x-llmtap-property-Team-Name", b"search"),
            (b"x-llmtap-property-env", b"prod"),
            (b"x-llmtap-tenant", b"second"),  # a header given twice keeps its first value
            (b"x-llmtap-property-", b"no name"),
            (b"x-llmtap-property-empty", b"   "),
        ],
        body_user="user-7",
        key_fingerprint="0123456789ab",
    )
    assert dims == {
        "tenant": "acme",
        "property.team_name": "search",
        "property.env": "prod",
        "user": "user-7",
        "api_key": "0123456789ab",
    }
    assert dropped == 0
    assert record_part(dims) == {
        "tenant": "acme",
        "user": "user-7",
        "api_key": "0123456789ab",
        "properties": {"team_name": "search", "env": "prod"},
    }
    assert record_part({}) is None
    # The header wins over the body.
    assert dimensions([(b"x-llmtap-user", b"from-header")], body_user="from-body")[0] == {"user": "from-header"}


def test_hostile_values_are_bounded_and_clean() -> None:
    headers = [(b"x-llmtap-tenant", b"\xff\xfe" + b"a\x00\x1b[31m" + b"x" * 100_000)]
    headers += [(f"x-llmtap-property-p{i}".encode(), b"v") for i in range(MAX_PROPERTIES + 10)]
    headers += [(b"x-llmtap-property-" + b"n" * 500, b"v")]
    dims, dropped = dimensions(headers)
    tenant = dims["tenant"]
    assert len(tenant) <= VALUE_CAP
    assert all(c.isprintable() for c in tenant) and tenant.startswith("\ufffd\ufffda\ufffd\ufffd[31mxxx")
    assert sum(k.startswith("property.") for k in dims) == MAX_PROPERTIES
    assert dropped == 11
    assert all(len(k) <= len("property.") + 64 for k in dims)


def test_the_protocols_name_their_end_user() -> None:
    chat = OpenAIChat().inspect(json.dumps({"model": "m", "messages": [], "user": "u1"}).encode(), inject_usage=False)
    assert chat.end_user == "u1"
    newer = {"model": "m", "messages": [], "user": "u1", "safety_identifier": "s1"}
    assert OpenAIChat().inspect(json.dumps(newer).encode(), inject_usage=False).end_user == "s1"
    body = {"model": "claude", "max_tokens": 5, "messages": [], "metadata": {"user_id": "a1"}}
    assert AnthropicMessages().inspect(json.dumps(body).encode(), inject_usage=False).end_user == "a1"
    body["metadata"] = "not a mapping"
    assert AnthropicMessages().inspect(json.dumps(body).encode(), inject_usage=False).end_user is None


def test_dimension_setting_accepts_known_names_only() -> None:
    kind = dimension_names()
    assert kind.parse("tenant, property.team,API_KEY") == ("tenant", "property.team", "api_key")
    assert kind.parse(["user", "user"]) == ("user",)
    for bad in ("tenant,org", "property.", "property.Bad-Name", ",".join(f"property.p{i}" for i in range(9))):
        with pytest.raises(Invalid):
            kind.parse(bad)


def test_dimension_attributes() -> None:
    assert sc.dimension_attribute("tenant") == "llmtap.tenant"
    assert sc.dimension_attribute("user") == "user.id"
    assert sc.dimension_attribute("api_key") == "llmtap.api_key.fingerprint"
    assert sc.dimension_attribute("property.team") == "llmtap.property.team"


def test_private_headers_stay_unless_the_operator_forwards_them() -> None:
    headers = [(b"x-llmtap-tenant", b"acme"), (b"X-LLMTAP-Property-A", b"1"), (b"authorization", b"Bearer k")]
    kept = request_headers(headers, trace=None, body_changed=False)
    assert kept == [(b"authorization", b"Bearer k")]
    assert request_headers(headers, trace=None, body_changed=False, private=True) == headers


# --- fingerprints -------------------------------------------------------------------------------


def test_a_fingerprint_is_keyed_short_and_never_the_key() -> None:
    secret = b"s" * 32
    key = b"sk-proj-abcdefghijklmnopqrstuvwxyz0123456789"
    fp = fingerprint(secret, b"Bearer " + key)
    assert len(fp) == FINGERPRINT_CHARS and int(fp, 16) >= 0
    assert fp == fingerprint(secret, key) == fingerprint(secret, b"bearer  " + key)  # the scheme is not the key
    assert fp != fingerprint(b"t" * 32, key)  # another secret, another fingerprint
    assert fp != fingerprint(secret, key + b"x")
    assert key.decode()[:FINGERPRINT_CHARS] != fp


def test_the_install_secret_is_made_once_and_kept(tmp_path: Path) -> None:
    first = install_secret(tmp_path / "state")
    assert len(first) >= 32
    assert install_secret(tmp_path / "state") == first
    assert (tmp_path / "state" / "attribution.key").stat().st_mode & 0o777 == 0o600


# --- cost ---------------------------------------------------------------------------------------


def test_shipped_prices_price_well_known_models_by_their_release_names() -> None:
    table = PriceTable()
    assert table.date >= "2025-01-01"
    assert normalize("openai/gpt-4o-2024-08-06") == "gpt-4o"
    assert normalize("claude-sonnet-4-5-20250929") == "claude-sonnet-4-5"
    found = table.lookup("gpt-4o-mini-2024-07-18")
    assert found is not None and found[0] == "gpt-4o-mini"
    cost = table.cost(("gpt-4o-mini",), input_tokens=1_000_000, output_tokens=1_000_000, cache_read_tokens=500_000)
    # 0.5M uncached at 0.15, 0.5M cached at 0.075, 1M output at 0.60 (per million).
    assert cost.status == PRICED and cost.amount == pytest.approx(0.075 + 0.0375 + 0.6)
    assert cost.prices == f"default {table.date}" and cost.source == LOCAL
    # Anthropic's input counts the cache's reads and writes: each at its own price.
    cost = table.cost(
        ("claude-sonnet-4-20250514",),
        input_tokens=3_000_000,
        output_tokens=0,
        cache_read_tokens=1_000_000,
        cache_write_tokens=1_000_000,
    )
    assert cost.amount == pytest.approx(3.0 + 0.3 + 3.75)


def test_anthropic_cache_writes_are_priced_by_their_lifetime() -> None:
    """5-minute writes at 1.25 times the input price, hour-long ones at twice it (Anthropic's pricing)."""
    parser = AnthropicMessages().stream_parser()
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "model": "claude-sonnet-4-5",
            "usage": {
                "input_tokens": 1_000_000,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 3_000_000,
                "cache_creation": {"ephemeral_5m_input_tokens": 1_000_000, "ephemeral_1h_input_tokens": 2_000_000},
                "output_tokens": 1,
            },
        },
    }
    facts = parser.feed(Event(event="message_start", data=json.dumps(start)))
    assert facts is not None and facts.usage is not None
    usage = facts.usage
    assert usage.cache_write_tokens == 3_000_000 and usage.cache_write_1h_tokens == 2_000_000
    table = PriceTable()
    cost = table.cost(
        ("claude-sonnet-4-5",),
        input_tokens=usage.input_tokens,
        output_tokens=0,
        cache_write_tokens=usage.cache_write_tokens,
        cache_write_1h_tokens=usage.cache_write_1h_tokens,
    )
    # 1M uncached at 3.00, 1M 5-minute writes at 3.75 (1.25x), 2M hour-long writes at 6.00 (2x), per million.
    assert cost.amount == pytest.approx(3.0 + 3.75 + 2 * 6.0)
    found = table.lookup("claude-sonnet-4-5")
    assert found is not None
    price = found[1]
    assert price.cache_write == pytest.approx(1.25 * price.input) and price.cache_write_1h == pytest.approx(
        2 * price.input
    )


def _chat_timeline(**usage: object) -> Timeline:
    """A finished chat request whose final chunk carried ``usage``."""
    tl = Timeline(
        method="POST",
        path="/v1/chat/completions",
        route="default",
        upstream="",
        server_address="",
        server_port=0,
        protocol="openai_chat",
        provider_name="openai",
        received=0.0,
        received_wall_ns=0,
    )
    tl.request = OpenAIChat().inspect(b'{"model": "gpt-4o", "stream": true}', inject_usage=False)
    parser = OpenAIChat().stream_parser()
    facts = parser.feed(Event(event="", data=json.dumps({"id": "c", "model": "gpt-4o", "choices": [], "usage": usage})))
    assert facts is not None and facts.usage is not None
    tl.usage = facts.usage
    return tl


def _summary(tl: Timeline) -> Summary:
    s = Summary()
    assert tl.usage is not None
    s.input_tokens, s.input_source = tl.usage.input_tokens, "usage"
    s.output_tokens, s.output_source = tl.usage.output_tokens, "usage"
    return s


def test_a_cost_the_response_states_wins_over_the_table() -> None:
    """OpenRouter and LiteLLM put ``usage.cost`` in the final chunk: taken as it is, ``source`` provider."""
    tl = _chat_timeline(prompt_tokens=1000, completion_tokens=10, cost=0.0125)
    cost = request_cost(PriceTable(), tl, _summary(tl))
    assert (cost.status, cost.amount, cost.source, cost.prices) == (PRICED, 0.0125, PROVIDER, None)
    # Without a stated cost, the table prices it: source local, the table named with its date.
    tl = _chat_timeline(prompt_tokens=1000, completion_tokens=10)
    cost = request_cost(PriceTable(), tl, _summary(tl))
    assert cost.source == LOCAL and cost.prices is not None and cost.prices.startswith("default 20")
    assert cost.amount == pytest.approx((1000 * 2.5 + 10 * 10.0) / 1e6)


def test_a_gateway_cost_header_is_read_and_a_malformed_cost_is_never_taken() -> None:
    assert header_cost({"x-litellm-response-cost": "0.00042"}) == pytest.approx(0.00042)
    assert header_cost({"x-litellm-response-cost": "free"}) is None
    assert header_cost({"x-litellm-response-cost": "-1"}) is None
    assert header_cost({}) is None
    tl = _chat_timeline(prompt_tokens=1000, completion_tokens=10)
    tl.header_cost = 0.5
    cost = request_cost(PriceTable(), tl, _summary(tl))
    assert (cost.amount, cost.source) == (0.5, PROVIDER)
    # A body's usage.cost that is not a number: not a cost; the table prices the request instead.
    tl = _chat_timeline(prompt_tokens=1000, completion_tokens=10, cost="n/a")
    assert tl.usage is not None and tl.usage.cost is None
    assert request_cost(PriceTable(), tl, _summary(tl)).source == LOCAL


def test_an_unknown_model_is_priced_as_unknown_never_zero() -> None:
    table = PriceTable()
    cost = table.cost(("my-finetune", None), input_tokens=10, output_tokens=10)
    assert cost.status == UNKNOWN_MODEL and cost.amount is None
    assert table.cost(("gpt-4o",), input_tokens=None, output_tokens=None).status == NO_USAGE
    # The response's model first, the request's next.
    assert table.cost(("unknown-alias", "gpt-4o"), input_tokens=1, output_tokens=1).model == "gpt-4o"


def test_a_user_file_wins_and_prices_anything(tmp_path: Path) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text(
        "models:\n  gpt-4o: {input: 1.0, output: 2.0}\n  Qwen/Qwen2.5-0.5B-Instruct: {input: 0, output: 0}\n",
        encoding="utf-8",
    )
    table = PriceTable(str(path))
    mine = table.cost(("gpt-4o",), input_tokens=1_000_000, output_tokens=1_000_000, cache_read_tokens=1_000_000)
    # cached at the input price
    assert mine.amount == pytest.approx(1.0 + 2.0) and mine.prices == "file" and mine.source == LOCAL
    free = table.cost(("qwen/qwen2.5-0.5b-instruct",), input_tokens=5, output_tokens=5)
    assert free.status == PRICED and free.amount == 0.0
    assert table.cost(("claude-3-haiku",), input_tokens=1, output_tokens=1).status == PRICED  # the rest stay


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models: [1]", "expected a mapping"),
        ("models: {m: {input: 1}}", "'output' is missing"),
        ("models: {m: {input: -1, output: 1}}", "expected a number >= 0"),
        ("models: {m: {input: 1, output: 1, extra: 1}}", "unknown key 'extra'"),
        ("currency: EUR\nmodels: {m: {input: 1, output: 1}}", "only USD"),
        ("models: {m: {input: 1, output: [", "not valid"),
    ],
)
def test_a_bad_price_file_says_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PriceError, match=message):
        PriceTable(str(path))


# --- embeddings ---------------------------------------------------------------------------------


def test_openai_embeddings_are_recognised_with_their_tokens() -> None:
    provider = provider_for("POST", "/v1/embeddings")
    assert isinstance(provider, OpenAIEmbeddings)
    info = provider.inspect(
        b'{"model": "text-embedding-3-small", "input": ["a b", "c"], "user": "u"}', inject_usage=True
    )
    assert (info.operation, info.model, info.stream, info.end_user) == (
        "embeddings",
        "text-embedding-3-small",
        False,
        "u",
    )
    assert info.prompt_text == "a b\nc"
    answer = {"object": "list", "data": [], "model": "text-embedding-3-small", "usage": {"prompt_tokens": 7}}
    facts = provider.parse_body(json.dumps(answer).encode())
    assert facts.usage is not None and facts.usage.input_tokens == 7 and facts.usage.output_tokens is None
    assert facts.response_model == "text-embedding-3-small" and not facts.has_content
    error = provider.parse_body(b'{"error": {"message": "no", "type": "invalid_request_error"}}')
    assert error.error_type == "invalid_request_error"
    assert provider.inspect(b"not json", inject_usage=False).parse_error


def test_ollama_embed_is_recognised_with_its_tokens_and_queue() -> None:
    provider = provider_for("POST", "/api/embed")
    assert isinstance(provider, OllamaEmbed)
    info = provider.inspect(b'{"model": "all-minilm", "input": "why is the sky blue"}', inject_usage=False)
    assert (info.operation, info.model, info.stream) == ("embeddings", "all-minilm", False)
    facts = provider.parse_body(b'{"model": "all-minilm", "embeddings": [[0.1]], "prompt_eval_count": 6, '
                                b'"total_duration": 14143917, "load_duration": 1019500}')  # fmt: skip
    assert facts.usage is not None and facts.usage.input_tokens == 6
    assert facts.server_timing is not None and facts.server_timing.queue == pytest.approx(0.0010195)


# --- compare and slo: cost per request ----------------------------------------------------------


def _records_with_costs() -> list[dict[str, object]]:
    """v1: 10 requests at $0.002 each (2 unpriced); v2: 10 at $0.0015. Amounts are as records carry them."""
    out: list[dict[str, object]] = []
    for i in range(20):
        version = "v1" if i < 10 else "v2"
        cost: dict[str, object] | None
        if version == "v1" and i < 2:
            cost = {"amount": None, "currency": "USD", "status": "unknown_model", "prices": None}
        else:
            amount = 0.002 if version == "v1" else 0.0015
            cost = {"amount": amount, "currency": "USD", "status": "priced", "prices": "file"}
        out.append(
            {
                "llmtap_record": 2,
                "time": f"2026-05-01T12:{i:02d}:00.000+00:00",
                "route": "default",
                "model": "m",
                "shape": "short",
                "prompt_version": version,
                "outcome": "ok",
                "stream": True,
                "ttft": 0.2 + i / 1000,
                "e2e": 1.0,
                "tokens": {"input": 1000, "cache_read": 0},
                "objective": {"shape": None, "percentile": 0.9, "ttft": 0.5, "tpot": None, "e2e": None},
                "cost": cost,
            }
        )
    return out


@pytest.mark.parametrize("engine", ["python", "duckdb"])
def test_compare_and_slo_report_cost_per_request(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmtap import cli

    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records_with_costs()), encoding="utf-8")
    assert cli.main(["compare", str(path), "--before", "v1", "--after", "v2", "--engine", engine]) == 0
    out = capsys.readouterr().out
    assert "cost per request: before $0.002 (8 of 10 priced), after $0.0015 (10 of 10 priced): -25.0%" in out, out
    assert cli.main(["compare", str(path), "--before", "v1", "--after", "v2", "--engine", engine, "--json"]) == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    assert cost["before"]["priced"] == 8 and cost["after"]["total"] == pytest.approx(0.015)
    assert cost["relative"] == pytest.approx(-0.25)
    assert cli.main(["slo", str(path), "--engine", engine]) == 0
    out = capsys.readouterr().out
    assert "cost per request by route and shape:" in out
    assert "default short: $0.001722 (18 of 20 priced), $0.031 in all" in out, out


def test_settings_check_prices_key_and_dimensions_at_start(tmp_path: Path) -> None:
    from llmtap.config.load import build
    from llmtap.config.types import ConfigError

    bad = tmp_path / "prices.yaml"
    bad.write_text("models: {m: {input: 1}}", encoding="utf-8")
    with pytest.raises(ConfigError, match="'output' is missing"):
        build({"upstream": "http://127.0.0.1:1", "prices": str(bad)}, env={})
    with pytest.raises(ConfigError, match="at least 16 characters"):
        build({"upstream": "http://127.0.0.1:1"}, env={"LLMTAP_ATTRIBUTION_KEY": "short"})
    key_file = tmp_path / "key"
    key_file.write_text("k" * 32 + "\n", encoding="utf-8")
    env = {"LLMTAP_METRIC_DIMENSIONS": "tenant,property.team", "LLMTAP_ATTRIBUTION_KEY_FILE": str(key_file)}
    settings = build({"upstream": "http://127.0.0.1:1"}, env=env).attribution
    assert settings.metric_dimensions == ("tenant", "property.team") and settings.key == b"k" * 32
    assert "k" * 32 not in repr(settings)
    with pytest.raises(ConfigError, match=r"LLMTAP_METRIC_DIMENSIONS=tenant,org: .org.: expected a list of tenant"):
        build({"upstream": "http://127.0.0.1:1"}, env={"LLMTAP_METRIC_DIMENSIONS": "tenant,org"})
