"""helm/llmtap: what the chart gives an operator beyond the proxy.

The values every replica must share (the attribution key, the admin and peer tokens) come from one Secret; the
grace period is the shutdown budget, and a shorter one is refused; the collector sidecar's health check answers
on the pod's address; the model server can run in llmtap's pod; the burn-rate rules pass ``promtool check rules``
and fire, under ``promtool test rules``, on traffic that burns the budget and stay quiet on traffic that does not.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmtap.analysis.burnrate import rule_groups
from tests.conftest import require_real
from tests.deploy.test_helm import CHART, by_kind, manifests, values_of

DEFAULTS = values_of(CHART / "values.yaml")


def _pod(values: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind(manifests(values))["Deployment"][0]["spec"]["template"]["spec"]
    return spec


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


# --- the shared secrets ------------------------------------------------------------------------------


def test_values_given_become_one_secret_every_replica_reads() -> None:
    case = values_of(CHART / "ci" / "secrets-values.yaml")
    docs = by_kind(manifests(case))
    (secret,) = docs["Secret"]
    name = secret["metadata"]["name"]
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert data == {
        "attribution-key": case["attribution"]["key"],
        "admin-token": case["admin"]["token"],
        "peer-token": case["peers"]["token"],
    }
    env = _env(docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0])
    refs = {v: env[v]["valueFrom"]["secretKeyRef"] for v in ("LLMTAP_ATTRIBUTION_KEY", "LLMTAP_ADMIN_TOKEN")}
    assert refs == {
        "LLMTAP_ATTRIBUTION_KEY": {"name": name, "key": "attribution-key"},
        "LLMTAP_ADMIN_TOKEN": {"name": name, "key": "admin-token"},
    }
    # Nothing secret in the ConfigMap.
    (config_map,) = docs["ConfigMap"]
    assert not any(value in config_map["data"]["llmtap.yaml"] for value in data.values())


def test_an_existing_secret_is_read_and_none_is_made() -> None:
    docs = by_kind(manifests({"attribution": {"existingSecret": "fleet-keys", "existingSecretKey": "fp"}}))
    assert "Secret" not in docs
    env = _env(docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0])
    assert env["LLMTAP_ATTRIBUTION_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "fleet-keys", "key": "fp"}


@pytest.mark.parametrize(
    ("values", "named"),
    [
        (
            {"attribution": {"key": "k" * 20, "existingSecret": "s"}},
            "give attribution.key or attribution.existingSecret",
        ),
        ({"admin": {"token": "t" * 20, "existingSecret": "s"}}, "give admin.token or admin.existingSecret"),
        ({"peers": {"enabled": True}}, "peers.enabled needs peers.token or peers.existingSecret"),
        ({"admin": {"token": "short"}}, "/admin/token"),
        ({"attribution": {"key": "has white space in it"}}, "/attribution/key"),
    ],
    ids=["key-twice", "token-twice", "peers-without-token", "short-token", "spaced-key"],
)
def test_a_secret_given_wrongly_is_refused_with_its_key_named(values: dict[str, Any], named: str) -> None:
    with pytest.raises(Exception, match=named.replace(".", r"\.")):
        manifests(values)


def test_notes_warn_when_replicas_share_no_attribution_key() -> None:
    from helm_python.chart import Chart

    def notes(values: dict[str, Any]) -> str:
        files = Chart.load(str(CHART)).render(values, name="rel", namespace="llm", is_install=True)
        return str(files["llmtap/templates/NOTES.txt"])

    assert "attribution.existingSecret=llmtap-attribution" in notes({})
    assert "API-key fingerprints" not in notes({"attribution": {"existingSecret": "fleet-keys"}})


# --- the shutdown budget -----------------------------------------------------------------------------


def test_the_grace_period_is_the_shutdown_budget() -> None:
    timeouts = DEFAULTS["config"]["timeouts"]
    budget = DEFAULTS["preStopSleepSeconds"] + timeouts["drain"] + timeouts["flush"] + 5
    assert DEFAULTS["terminationGracePeriodSeconds"] is None
    assert _pod({})["terminationGracePeriodSeconds"] == budget
    # It follows the values it is made of.
    longer = {"preStopSleepSeconds": 10, "config": {"timeouts": {"drain": 120, "flush": 2.5}}}
    assert _pod(longer)["terminationGracePeriodSeconds"] == 10 + 120 + 3 + 5
    # A value at least the budget is kept; a shorter one is refused with the sum named.
    assert _pod({"terminationGracePeriodSeconds": budget + 30})["terminationGracePeriodSeconds"] == budget + 30
    with pytest.raises(Exception, match=f"terminationGracePeriodSeconds 44 is less than the shutdown budget {budget}"):
        manifests({"terminationGracePeriodSeconds": 44})


def test_the_budget_is_what_llmtap_reads() -> None:
    """The drain and flush the budget adds up are the ones llmtap is given (its timeouts.drain and .flush)."""
    (config_map,) = by_kind(manifests({"config": {"timeouts": {"drain": 12, "flush": 3}}}))["ConfigMap"]
    config = yaml.safe_load(config_map["data"]["llmtap.yaml"])
    assert (config["timeouts"]["drain"], config["timeouts"]["flush"]) == (12, 3)


# --- the collector sidecar and the model server in the pod ---------------------------------------------


def test_the_collector_health_check_listens_where_the_kubelet_probes() -> None:
    docs = by_kind(manifests(values_of(CHART / "ci" / "sidecar-values.yaml")))
    (config_map,) = [c for c in docs["ConfigMap"] if "config.yaml" in c["data"]]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    host, port = config["extensions"]["health_check"]["endpoint"].rsplit(":", 1)
    assert host == "0.0.0.0"  # the kubelet probes the pod IP, not the pod's loopback
    collector = [c for c in docs["Deployment"][0]["spec"]["template"]["spec"]["containers"] if c["name"] == "collector"]
    assert collector[0]["livenessProbe"]["httpGet"]["port"] == int(port)
    # The files in collectors/ agree.
    for path in sorted((CHART.parent.parent / "collectors").glob("*.yaml")):
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
        extensions = config.get("extensions") if isinstance(config, dict) else None
        health = extensions.get("health_check") if isinstance(extensions, dict) else None
        if isinstance(health, dict) and "endpoint" in health:
            assert health["endpoint"].startswith("0.0.0.0:"), path.name


def test_the_model_server_runs_in_llmtaps_pod_behind_it() -> None:
    case = values_of(CHART / "ci" / "model-server-values.yaml")
    docs = by_kind(manifests(case))
    pod = docs["Deployment"][0]["spec"]["template"]["spec"]
    proxy, server = pod["containers"]
    assert server["name"] == "model-server" and server["image"] == case["modelServer"]["image"]
    assert server["args"] == case["modelServer"]["args"] and server["resources"] == case["modelServer"]["resources"]
    assert "ports" not in server  # reached over the pod's loopback, by llmtap only
    assert proxy["resources"]["limits"]["cpu"] == "1"  # llmtap on one core beside it
    (config_map,) = docs["ConfigMap"]
    routes = yaml.safe_load(config_map["data"]["llmtap.yaml"])["routes"]
    assert routes == [{"prefix": "/", "upstream": "http://127.0.0.1:8000", "provider": "vllm"}]
    # llmtap's own restrictions stay on llmtap's container: the model server's image decides its user.
    assert "runAsNonRoot" not in pod["securityContext"] and "securityContext" not in server
    assert proxy["securityContext"]["runAsNonRoot"] is True


# --- the network policy ------------------------------------------------------------------------------


def test_the_network_policy_keeps_the_admin_port_to_its_peers() -> None:
    case = values_of(CHART / "ci" / "alerts-values.yaml")
    docs = by_kind(manifests(case))
    (policy,) = docs["NetworkPolicy"]
    selector = docs["Deployment"][0]["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["podSelector"]["matchLabels"] == selector
    rules = {r["ports"][0]["port"]: r.get("from") for r in policy["spec"]["ingress"]}
    assert rules["http"] == case["networkPolicy"]["clients"]
    policy_case = case["networkPolicy"]
    assert rules["admin"] == [
        *policy_case["scrapers"],
        *policy_case["modelServers"],
        {"podSelector": {"matchLabels": selector}},
    ]
    # The named ports are the container's.
    ports = {p["name"] for p in docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert set(rules) <= ports
    assert "NetworkPolicy" not in by_kind(manifests({}))


# --- burn-rate alerts --------------------------------------------------------------------------------


def _rule_file(tmp_path: Path, values: dict[str, Any]) -> Path:
    (rule,) = by_kind(manifests(values))["PrometheusRule"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}), encoding="utf-8")
    return path


def _promtool() -> str:
    found = shutil.which("promtool")
    require_real(found is not None, "promtool", "Debian's prometheus package; .ci/install.d/20-prometheus.sh")
    assert found is not None
    return found


def test_the_chart_renders_the_rules_llmtap_slo_prints() -> None:
    """The chart's PrometheusRule is ``llmtap slo --rules`` for its selector and labels: one source of the rules."""
    values = values_of(CHART / "ci" / "alerts-values.yaml")
    (rule,) = by_kind(manifests(values))["PrometheusRule"]
    selector = 'namespace="llm",job="rel-llmtap"'
    assert rule["spec"]["groups"][0]["rules"][0]["expr"].count(selector) == 3  # the release's own series
    expected = rule_groups(selector=selector, by="namespace, job", page="critical", ticket="warning")

    def flat(groups: Any) -> Any:
        # The same PromQL and YAML whatever the indentation of its lines.
        if isinstance(groups, dict):
            return {k: flat(v) for k, v in groups.items()}
        if isinstance(groups, list):
            return [flat(v) for v in groups]
        return " ".join(groups.split()) if isinstance(groups, str) else groups

    assert flat(rule["spec"]["groups"]) == flat(expected)


def test_the_rules_pass_promtool(tmp_path: Path) -> None:
    path = _rule_file(tmp_path, values_of(CHART / "ci" / "alerts-values.yaml"))
    done = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 10 rules found" in done.stdout


def _series(missed_per_min: int, met_per_min: int, minutes: int) -> list[dict[str, str]]:
    labels = 'namespace="llm",job="rel-llmtap",llmtap_route="default",llmtap_request_shape="short_prompt"'
    return [
        {"series": f'llmtap_requests_total{{llmtap_slo="missed",{labels}}}', "values": f"0+{missed_per_min}x{minutes}"},
        {"series": f'llmtap_requests_total{{llmtap_slo="met",{labels}}}', "values": f"0+{met_per_min}x{minutes}"},
        # Requests without an objective never count.
        {"series": f'llmtap_requests_total{{llmtap_slo="none",{labels}}}', "values": f"0+1000x{minutes}"},
        # The objective the pods export (config.slo.percentile): the budget is the rest.
        {"series": f"llmtap_slo_objective_ratio{{{labels}}}", "values": f"0.995x{minutes}"},
    ]


def test_the_alerts_fire_on_a_burning_budget_and_only_then(tmp_path: Path) -> None:
    """A route missing 20% of its requests against a 99.5% objective burns 40x: the fast alert fires within the
    ten minutes; missing 0.1% burns 0.2x: nothing fires, even after three days."""
    values = {"config": {"slo": {"ttft_ms": 500, "percentile": 0.995}}, "prometheusRule": {"enabled": True}}
    rules = _rule_file(tmp_path, values)
    fast = {
        "interval": "1m",
        "input_series": _series(20, 80, 120),
        "alert_rule_test": [
            {
                "eval_time": "10m",
                "alertname": "LlmtapErrorBudgetBurnFast",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "critical",
                            "namespace": "llm",
                            "job": "rel-llmtap",
                            "llmtap_route": "default",
                            "llmtap_request_shape": "short_prompt",
                        },
                        "exp_annotations": {
                            "summary": "llmtap route default (short_prompt) burns its SLO error budget fast",
                            "description": "Requests missing their objectives (TTFT, TPOT, end to end) burn the error "
                            "budget at 6x to 14.4x: at this rate a 30-day budget lasts 2 to 5 days.",
                        },
                    }
                ],
            },
        ],
    }
    quiet = {
        "interval": "10m",
        "input_series": _series(1, 999, 3 * 24 * 6 + 6),
        "alert_rule_test": [
            {"eval_time": "3d", "alertname": name, "exp_alerts": []}
            for name in ("LlmtapErrorBudgetBurnFast", "LlmtapErrorBudgetBurnSlow")
        ],
    }
    test_file = tmp_path / "rules_test.yaml"
    test_file.write_text(
        yaml.safe_dump(
            {
                "rule_files": [rules.name],
                "evaluation_interval": "1m",
                # The recording group before the alerts that read it: promtool's order is arbitrary otherwise.
                "group_eval_order": [g["name"] for g in yaml.safe_load(rules.read_text(encoding="utf-8"))["groups"]],
                "tests": [fast, quiet],
            }
        ),
        encoding="utf-8",
    )
    done = subprocess.run(
        [_promtool(), "test", "rules", test_file.name], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
