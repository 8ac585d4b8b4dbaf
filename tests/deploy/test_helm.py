"""helm/llmtap: linted and rendered by Helm (v4, as a library), manifests validated for two Kubernetes versions.

Each values file in ``helm/llmtap/ci/`` is one CI case: ``helm lint --strict`` must report nothing above
info; the rendered manifests must validate, strictly, against the Kubernetes schemas of both versions; the
proxy's rendered config file must load in llmtap's own settings loader; the sidecar collector's config
must pass the same structural check as ``collectors/``; and the pieces must be wired to each other
(selectors, named ports, probes). Bad values fail lint with the key named.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from helm_python.chart import Chart, lint
from yamllint import linter  # type: ignore[import-untyped]
from yamllint.config import YamlLintConfig  # type: ignore[import-untyped]

from llmtap.config.load import build
from llmtap.config.otel import telemetry_from_env
from llmtap.config.types import Records
from tests.real.test_collectors import config_problems, load_distribution

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "llmtap"
CASES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBERNETES = ("1.30.0", "1.37.0")
#: prometheus-operator's kinds: kubernetes-validate has no schema for them.
CRDS = {"ServiceMonitor", "PrometheusRule"}
# Rendered manifests: yamllint's defaults, except what Helm's own toYaml output does not follow.
RENDERED_LINT = YamlLintConfig(
    "{extends: default, rules: {line-length: disable, document-start: disable,"
    " indentation: {indent-sequences: whatever}}}"
)


def values_of(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict), path
    return data


def render(values: Mapping[str, Any]) -> dict[str, str]:
    """Template file name -> rendered text, as ``helm template`` would print them."""
    files = Chart.load(str(CHART)).render(dict(values), name="rel", namespace="llm", is_install=True)
    return {name: text for name, text in files.items() if name.endswith(".yaml") and text.strip()}


def manifests(values: Mapping[str, Any]) -> list[dict[str, Any]]:
    docs = [doc for text in render(values).values() for doc in yaml.safe_load_all(text) if doc]
    assert all(isinstance(doc, dict) for doc in docs)
    return docs


def by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


@pytest.fixture(params=CASES, ids=[p.name.removesuffix("-values.yaml") for p in CASES])
def case(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    yield values_of(request.param)


#: The values every replica must share: (variable, values section, its value's field, key in the chart's Secret).
SHARED = (
    ("LLMTAP_ATTRIBUTION_KEY", "attribution", "key", "attribution-key"),
    ("LLMTAP_ADMIN_TOKEN", "admin", "token", "admin-token"),
    ("LLMTAP_PEER_TOKEN", "peers", "token", "peer-token"),
)


def secret_env(container: Mapping[str, Any], secrets: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The shared values' variables as the pod gets them from their Secrets: a rendered Secret's value, else a
    stand-in for an existing Secret's (made beforehand, outside the chart)."""
    out = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref is None or e["name"] not in {variable for variable, *_ in SHARED}:
            continue
        made = secrets.get(ref["name"])
        value = (
            base64.b64decode(made["data"][ref["key"]]).decode() if made else f"{ref['name']}-{ref['key']}-0123456789"
        )
        out[e["name"]] = value
    return out


def test_the_ci_matrix_covers_the_options() -> None:
    names = {p.name for p in CASES}
    assert {
        "default-values.yaml",
        "scale-values.yaml",
        "sidecar-values.yaml",
        "multi-route-values.yaml",
        "records-values.yaml",
        "secrets-values.yaml",
        "model-server-values.yaml",
        "alerts-values.yaml",
    } <= names


@pytest.mark.parametrize("kube", KUBERNETES)
def test_lint_strict(case: dict[str, Any], kube: str) -> None:
    report = lint(str(CHART), case, strict=True, kube_version=f"v{kube}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_rendered_manifests_validate_for_two_kubernetes_versions(case: dict[str, Any]) -> None:
    docs = manifests(case)
    checked = 0
    for doc in docs:
        if doc["kind"] in CRDS:
            continue  # a CRD: no schema in kubernetes-validate; its wiring is checked below
        for kube in KUBERNETES:
            kubernetes_validate.validate(doc, kube, strict=True)
            checked += 1
    assert {"Deployment", "Service", "ConfigMap"} <= {d["kind"] for d in docs}
    assert checked == len(KUBERNETES) * len([d for d in docs if d["kind"] not in CRDS])


def test_a_bad_manifest_fails_validation() -> None:
    deployment = by_kind(manifests({}))["Deployment"][0]
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eighty"
    deployment["spec"]["replicass"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES[0], strict=True)


def test_rendered_yaml_lints(case: dict[str, Any]) -> None:
    problems = [
        f"{name}:{p.line}: {p.message}" for name, text in render(case).items() for p in linter.run(text, RENDERED_LINT)
    ]
    assert problems == []


def test_rendered_config_loads_in_llmtap(case: dict[str, Any], tmp_path: Path) -> None:
    docs = by_kind(manifests(case))
    (config_map,) = [c for c in docs["ConfigMap"] if "llmtap.yaml" in c["data"]]
    config = yaml.safe_load(config_map["data"]["llmtap.yaml"])
    admin = {**values_of(CHART / "values.yaml")["admin"], **case.get("admin", {})}
    pod = docs["Deployment"][0]["spec"]["template"]["spec"]
    # The shared secrets reach the pod as variables from their Secrets (secretKeyRef), never in the ConfigMap.
    env = secret_env(pod["containers"][0], {s["metadata"]["name"]: s for s in docs.get("Secret", [])})
    assert "token_file" not in config["admin"] and "key_file" not in config.get("attribution", {})
    assert ("LLMTAP_ADMIN_TOKEN" in env) is bool(admin["token"] or admin["existingSecret"])
    path = tmp_path / "llmtap.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    loaded = build({"config": str(path)}, env=env)
    assert (loaded.admin.token is not None) is bool(admin["token"] or admin["existingSecret"])
    attribution = {**values_of(CHART / "values.yaml")["attribution"], **case.get("attribution", {})}
    assert (loaded.attribution.key is not None) is bool(attribution["key"] or attribution["existingSecret"])
    assert (loaded.admin.loopback_token, loaded.admin.max_connections, loaded.admin.max_event_streams) == (
        admin["loopbackToken"],
        admin["maxConnections"],
        admin["maxEventStreams"],
    )
    service = docs["Service"][0]["spec"]["ports"]
    assert {"http": loaded.port, "admin": loaded.admin_port} == {p["name"]: p["port"] for p in service}
    assert loaded.host == loaded.admin_host == "0.0.0.0"
    expected = case.get("config", {}).get("routes") or values_of(CHART / "values.yaml")["config"]["routes"]
    model_server = case.get("modelServer", {})
    if model_server.get("enabled"):  # one route, to the model server in the pod
        expected = [{"upstream": f"http://127.0.0.1:{model_server['port']}"}]
    assert sorted(r.upstream for r in loaded.routes) == sorted(r["upstream"] for r in expected)
    defaults = values_of(CHART / "values.yaml")["config"]
    timeouts = {**defaults["timeouts"], **case.get("config", {}).get("timeouts", {})}
    assert (loaded.timeouts.client_header, loaded.timeouts.client_body, loaded.timeouts.keep_alive) == (
        timeouts["client_header"],
        timeouts["client_body"],
        timeouts["keep_alive"],
    )
    assert loaded.max_client_connections == case.get("config", {}).get("max_client_connections")
    telemetry = {**defaults["telemetry"], **case.get("config", {}).get("telemetry", {})}
    assert (loaded.telemetry.histogram_buckets, loaded.telemetry.server_metrics) == (
        telemetry["histogram_buckets"],
        telemetry["server_metrics"],
    )
    record = {**defaults["record"], **case.get("config", {}).get("record", {})}
    records = {**values_of(CHART / "values.yaml")["records"], **case.get("records", {})}
    # The ClickHouse part of the records has a case of its own (below).
    assert bool(loaded.record.clickhouse) is bool(case.get("clickhouse", {}).get("url"))
    assert dataclasses.replace(loaded.record, clickhouse=None) == Records(
        path=records["mountPath"] if records.get("enabled") else None,
        max_bytes=int(record["max_mb"] * (1 << 20)),
        rotate_s=record["rotate_minutes"] * 60,
        keep_bytes=int(record["keep_mb"] * (1 << 20)),
        keep_s=record["keep_hours"] * 3600,
        format=record["format"],
        logs=record["logs"],
        journal=records["mountPath"] + "/.journal" if records.get("enabled") else None,
        journal_bytes=int(record["journal_mb"] * (1 << 20)),
    )


def test_sidecar_collector_config_passes_the_collector_checks() -> None:
    docs = by_kind(manifests(values_of(CHART / "ci" / "sidecar-values.yaml")))
    (config_map,) = [c for c in docs["ConfigMap"] if "config.yaml" in c["data"]]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config_problems(config, load_distribution()) == []
    assert config["exporters"]["otlp_grpc"]["endpoint"] == "otelcol-gateway.observability:4317"
    pod = docs["Deployment"][0]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["llmtap", "collector"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4317"
    assert "deployment.environment=prod" in env["OTEL_RESOURCE_ATTRIBUTES"]


def test_pieces_are_wired_to_each_other(case: dict[str, Any]) -> None:
    docs = by_kind(manifests(case))
    (deployment,) = docs["Deployment"]
    (service,) = docs["Service"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod = deployment["spec"]["template"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"] == selector
    proxy = pod["spec"]["containers"][0]
    ports = {p["name"] for p in proxy["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert "OTEL_RESOURCE_ATTRIBUTES" in {e["name"] for e in proxy["env"]}
    hpa_on = bool(case.get("hpa", {}).get("enabled"))
    assert ("replicas" in deployment["spec"]) is not hpa_on
    for hpa in docs.get("HorizontalPodAutoscaler", []):
        assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    for pdb in docs.get("PodDisruptionBudget", []):
        assert pdb["spec"]["selector"]["matchLabels"] == selector
    for monitor in docs.get("ServiceMonitor", []):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["admin"]
    secrets = case.get("secretEnv", {})
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in proxy["env"]
        if "valueFrom" in e and "secretKeyRef" in e["valueFrom"] and e["name"] != "LLMTAP_RECORD_CLICKHOUSE_PASSWORD"
    }
    # The values every replica shares: each from its existing Secret, or from the chart's own.
    own = docs["Deployment"][0]["metadata"]["name"]
    for variable, section, field, own_key in SHARED:
        given = case.get(section, {})
        if section == "peers" and not given.get("enabled"):
            assert variable not in refs
        elif given.get("existingSecret"):
            assert refs.pop(variable) == {"name": given["existingSecret"], "key": given.get("existingSecretKey", field)}
        elif given.get(field):
            assert refs.pop(variable) == {"name": own, "key": own_key}
        else:
            assert variable not in refs
    assert {k: v["key"] for k, v in refs.items()} == secrets
    assert all(v["name"] == case.get("secretName") for v in refs.values())


def test_the_scale_case_renders_its_options() -> None:
    docs = by_kind(manifests(values_of(CHART / "ci" / "scale-values.yaml")))
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor"} <= set(docs)
    (hpa,) = docs["HorizontalPodAutoscaler"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (10, 100)
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Resource", "Pods"]
    assert "release" in docs["ServiceMonitor"][0]["metadata"]["labels"]
    (deployment,) = docs["Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"] == "base2_exponential_bucket_histogram"
    # Span routing between the pods: each names itself by pod IP and admin port, with the shared token.
    variables = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert variables["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["LLMTAP_PEER_ADDRESS"] == "$(POD_IP):9464"
    assert variables["LLMTAP_PEER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "llmtap-peers", "key": "token"}
    assert "Secret" not in docs  # an existing Secret is read, not made
    names = [e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert names.index("POD_IP") < names.index("LLMTAP_PEER_ADDRESS")  # $(POD_IP) expands only from earlier ones
    # The address and token the pods get are what llmtap takes.
    loaded = telemetry_from_env(
        {"LLMTAP_PEER_ADDRESS": env["LLMTAP_PEER_ADDRESS"].replace("$(POD_IP)", "10.0.3.7"), "LLMTAP_PEER_TOKEN": "t"}
    )
    assert loaded.peer_address == "10.0.3.7:9464"
    # Off by default; on without a Secret, the chart refuses with the key named.
    default = by_kind(manifests({}))["Deployment"][0]
    assert "LLMTAP_PEER_ADDRESS" not in {e["name"] for e in default["spec"]["template"]["spec"]["containers"][0]["env"]}
    with pytest.raises(Exception, match=r"peers\.enabled needs peers\.token or peers\.existingSecret"):
        manifests({"peers": {"enabled": True}})


def test_records_get_a_writable_volume_under_the_read_only_root() -> None:
    values = values_of(CHART / "ci" / "records-values.yaml")
    docs = by_kind(manifests(values))
    pod = docs["Deployment"][0]["spec"]["template"]["spec"]
    proxy = pod["containers"][0]
    assert proxy["securityContext"]["readOnlyRootFilesystem"] is True
    (mount,) = [m for m in proxy["volumeMounts"] if m["name"] == "records"]
    assert mount["mountPath"] == "/var/lib/llmtap/records" and not mount.get("readOnly")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "records"]
    assert volume == {"name": "records", "emptyDir": {"sizeLimit": "4Gi"}}
    (config_map,) = [c for c in docs["ConfigMap"] if "llmtap.yaml" in c["data"]]
    record = yaml.safe_load(config_map["data"]["llmtap.yaml"])["record"]
    assert record == {
        "path": "/var/lib/llmtap/records",
        "format": "jsonl",
        "journal_mb": 128,
        **values["config"]["record"],
    }
    # (llmtap reads it as the folder, with the rotation, retention and logs set: test_rendered_config_loads_in_llmtap.)
    claimed = by_kind(manifests({**values, "records": {**values["records"], "existingClaim": "llmtap-records"}}))
    (volume,) = [v for v in claimed["Deployment"][0]["spec"]["template"]["spec"]["volumes"] if v["name"] == "records"]
    assert volume == {"name": "records", "persistentVolumeClaim": {"claimName": "llmtap-records"}}
    # Off by default: no volume, no record path (so no records), the settings still accepted.
    default = by_kind(manifests(values_of(CHART / "ci" / "default-values.yaml")))
    assert "records" not in {v["name"] for v in default["Deployment"][0]["spec"]["template"]["spec"]["volumes"]}
    (config_map,) = [c for c in default["ConfigMap"] if "llmtap.yaml" in c["data"]]
    assert "path" not in yaml.safe_load(config_map["data"]["llmtap.yaml"])["record"]


def test_the_clickhouse_case_sends_records_with_the_password_from_its_secret(tmp_path: Path) -> None:
    case = values_of(CHART / "ci" / "clickhouse-values.yaml")
    docs = by_kind(manifests(case))
    (config_map,) = [c for c in docs["ConfigMap"] if "llmtap.yaml" in c["data"]]
    assert "secret" not in config_map["data"]["llmtap.yaml"].lower()
    path = tmp_path / "llmtap.yaml"
    path.write_text(config_map["data"]["llmtap.yaml"], encoding="utf-8")
    env = {e["name"]: e for e in docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = env["LLMTAP_RECORD_CLICKHOUSE_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "clickhouse-llmtap", "key": "password"}
    # As the pod reads it: the file, and the variable Kubernetes fills from the Secret.
    loaded = build({"config": str(path)}, env={"LLMTAP_RECORD_CLICKHOUSE_PASSWORD": "pw"})
    got = loaded.record.clickhouse
    assert got is not None
    assert (got.url, got.table, got.user, got.password, got.ttl_days, got.max_records) == (
        "http://clickhouse.db:8123",
        "llm.requests",
        "llmtap",
        "pw",
        90,
        50000,
    )
    # Off by default: no ClickHouse in the config, no password variable.
    default = by_kind(manifests({}))
    (plain,) = [c for c in default["ConfigMap"] if "llmtap.yaml" in c["data"]]
    assert "clickhouse" not in plain["data"]["llmtap.yaml"]
    default_env = default["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "LLMTAP_RECORD_CLICKHOUSE_PASSWORD" not in {e["name"] for e in default_env}


# --- values: commented, closed, and enforced ----------------------------------------------------


def test_every_value_is_commented() -> None:
    lines = (CHART / "values.yaml").read_text(encoding="utf-8").splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        if not re.match(r"^\s*(- )?[A-Za-z_][\w.]*:", line):
            continue
        previous = next((p for p in reversed(lines[:i]) if p.strip()), "")
        if " # " not in line and not previous.lstrip().startswith("#"):
            uncommented.append(f"{i + 1}: {line.strip()}")
    assert uncommented == []


def _walk(schema: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")


SCHEMA = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))


def test_values_schema_is_closed() -> None:
    for path, node in _walk(SCHEMA):
        if node.get("type") != "object":
            continue
        extra = node.get("additionalProperties")
        if "properties" in node:
            assert extra is False, f"{path or '(root)'}: an object with named keys must refuse others"
        else:
            # Label, annotation, selector and Secret maps have free keys, but only string values.
            assert extra == {"type": "string"} or extra == {"type": "string", "minLength": 1}, path


def _keys(values: Mapping[str, Any], schema: Mapping[str, Any], path: str = "") -> list[str]:
    """Values keys the schema does not describe, and schema keys values.yaml lacks."""
    if "properties" not in schema:
        return []
    props = schema["properties"]
    out = [f"{path}.{k}: not in the schema" for k in values if k not in props]
    out += [f"{path}.{k}: not in values.yaml" for k in props if k not in values]
    for key, value in values.items():
        if isinstance(value, dict) and key in props:
            out += _keys(value, props[key], f"{path}.{key}")
    return out


def test_schema_and_values_describe_the_same_keys() -> None:
    values = values_of(CHART / "values.yaml")
    assert _keys(values, SCHEMA) == []


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ("replicas: 3\n", "additional properties 'replicas' not allowed"),
        ("replicaCount: two\n", "at '/replicaCount': got string, want integer"),
        ("config:\n  routes:\n    - upstream: http://vllm:8000\n      prefx: /\n", "'prefx' not allowed"),
        ("service:\n  port: '8080'\n", "at '/service/port': got string, want integer"),
        ("hpa:\n  enabled: true\n  maxReplicas: many\n", "at '/hpa/maxReplicas'"),
        ("clickhouse:\n  url: http://u:pw@clickhouse:8123\n", "at '/clickhouse/url'"),
    ],
    ids=["unknown-key", "wrong-type", "unknown-route-key", "port-as-string", "nested-wrong-type", "password-in-url"],
)
def test_bad_values_fail_lint_with_the_key_named(bad: str, named: str, tmp_path: Path) -> None:
    values_file = tmp_path / "bad-values.yaml"
    values_file.write_text(bad, encoding="utf-8")
    report = lint(str(CHART), values_of(values_file), strict=True, kube_version=f"v{KUBERNETES[0]}")
    assert report["errors"], bad
    assert any(named in error for error in report["errors"]), report["errors"]


def test_readme_explains_scaling_out() -> None:
    readme = (CHART / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Scaling out", 1)[1]
    assert "10 replicas" in section and "100 replicas" in section
