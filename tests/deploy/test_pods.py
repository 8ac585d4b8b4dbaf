"""The chart run as pods (real tier): the rendered chart played with ``podman kube play``, with the image
CI builds (``.ci/image.sh``, tagged ``localhost/llmtap:<version>``), in front of a simulator pod.

Two replicas (``helm/llmtap/ci/pods-values.yaml``), their ConfigMap, the chart's Secret (the admin token) and an
existing one (the attribution key), the records on one volume and a collector sidecar. Checked: 200 requests
through both replicas all answered, 200 records on the volume, one API key with one fingerprint on both replicas
and after a restart, ``/healthz`` and ``/readyz`` answering 200, the admin token from its Secret in force beyond
the pod's loopback, the collector's health check reachable on the pod's address, a graceful stop during 20 streams
that finishes all 20 with the flush (to a collector that never answers) inside the grace period, and llmtap as
the sidecar of a model server in its pod (``modelServer``).

What kube play (podman 4.3) cannot express, and so is not tested here (tests/support/podkube.py says how the rest is
adapted): a Service's load balancing (the test spreads the requests over the pods' addresses itself), readiness
gating, the preStop hook (the test stops the container with the grace period as ``podman stop``'s timeout, as the
kubelet's SIGTERM then SIGKILL would), the HPA and PDB, ``$(POD_IP)`` in variables (so the peers' span routing,
whose address is made of it, is not played: tests/telemetry/test_fleet.py covers it between processes) and the real
collector image (no registry is reachable from here: a stand-in from llmtap's image binds the addresses the
chart's collector config names, its health check answering and its OTLP port holding every connection unanswered).
"""

from __future__ import annotations

import json
import subprocess
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import require_real
from tests.deploy.test_helm import CHART, ROOT, by_kind, manifests, values_of
from tests.support.podkube import Pods, b64, missing_tools, playable, secrets_of
from tests.support.records import written

NAMESPACE = "llm"
UID = values_of(CHART / "values.yaml")["runAsUser"]
KEY = "sk-pods-one-key-0123456789"
#: The collector's stand-in: it binds the addresses of the chart's collector config, the health check answering
#: 200 and the OTLP gRPC port taking connections it never reads (a collector that does not answer).
STAND_IN = """
import http.server, socket, yaml
config = yaml.safe_load(open("/etc/otelcol/config.yaml"))
host, port = config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)
hole = socket.create_server((host, int(port)), backlog=128)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"Server available")
host, port = config["extensions"]["health_check"]["endpoint"].rsplit(":", 1)
http.server.ThreadingHTTPServer((host, int(port)), Health).serve_forever()
"""


def image_tag() -> str:
    """The tag ``.ci/image.sh`` gives the image: the package's one version."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    return f"localhost/llmtap:{version}"


@dataclass
class Fleet:
    """The played pods: llmtap's replicas by name with their addresses, the records' folder, the release's values."""

    pods: Pods
    replicas: dict[str, str]
    records: Path
    values: dict[str, Any]
    grace: int

    def urls(self, port: int) -> list[str]:
        return [f"http://{ip}:{port}" for ip in self.replicas.values()]


def wait_records(folder: Path, n: int, deadline_s: float = 60) -> list[dict[str, Any]]:
    """Until the folder holds at least ``n`` records."""
    deadline = time.monotonic() + deadline_s
    while True:
        found = written(folder)
        if len(found) >= n or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _requirements() -> str:
    missing = missing_tools()
    require_real(not missing, " and ".join(missing), "apt-get install podman runc catatonit iproute2; run as root")
    tag = image_tag()
    found = subprocess.run(["podman", "image", "exists", tag], capture_output=True, timeout=60).returncode == 0
    require_real(found, f"the image {tag}", "bash .ci/image.sh (CI: .ci/install.d/60-image.sh)")
    return tag


def _volumes(pods: Pods, rendered: list[dict[str, Any]], run_id: str) -> None:
    """The release's emptyDirs as this run's volumes, writable by the pods' user (``playable`` names them)."""
    for doc in rendered:
        for volume in doc.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "emptyDir" in volume:
                pods.volume(f"{run_id}-{volume['name']}", UID)


def _simulator(pods: Pods, tag: str, run_id: str) -> str:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{run_id}-sim"},
        "spec": {
            "containers": [
                {
                    "name": "simulator",
                    "image": tag,
                    "command": ["llmtap", "simulate", "--host", "0.0.0.0", "--port", "8000", "--profile", "fast"],
                }
            ]
        },
    }
    (name,) = pods.play([pod])
    return pods.address(name)


def _stand_in_collector(docs: list[dict[str, Any]], tag: str) -> None:
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if container["name"] == "collector":
                container.update(image=tag, command=["python", "-c", STAND_IN.strip()], args=[])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tag = _requirements()
    run_id = f"llmtap-pods-{uuid.uuid4().hex[:8]}"
    pods = Pods(run_id, tmp_path_factory.mktemp("pods"))
    try:
        simulator = _simulator(pods, tag, run_id)
        values = values_of(CHART / "ci" / "pods-values.yaml")
        values["image"]["tag"] = tag.rsplit(":", 1)[1]
        values["config"]["routes"][0]["upstream"] = f"http://{simulator}:8000"
        values["attribution"]["existingSecret"] = f"{run_id}-attribution"
        values["records"]["existingClaim"] = f"{run_id}-records"
        values["fullnameOverride"] = run_id
        rendered = manifests(values)
        pods.secret(f"{run_id}-attribution", {"key": b64(f"the-fleet-fingerprint-secret-{run_id}")})
        for name, data in secrets_of(rendered).items():
            pods.secret(name, data)
        records = pods.volume(f"{run_id}-records", UID)
        _volumes(pods, rendered, run_id)
        docs = playable(rendered, run_id, NAMESPACE)
        _stand_in_collector(docs, tag)
        names = pods.play(docs)
        replicas = {name: pods.address(name) for name in names}
        grace = by_kind(rendered)["Deployment"][0]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        built = Fleet(pods, replicas, records, values, grace)
        for url in built.urls(9464):
            pods.wait_http(f"{url}/readyz", 90)
        yield built
    finally:
        pods.close()


def _logs(fleet: Fleet) -> str:
    return "\n".join(f"--- {name}\n{fleet.pods.logs(f'{name}-llmtap')}" for name in fleet.replicas)


def test_two_replicas_answer_200_requests_and_record_each_once(fleet: Fleet) -> None:
    assert len(fleet.replicas) == 2, fleet.replicas
    done = fleet.pods.client("drive", ",".join(fleet.urls(8080)), "200", KEY)
    assert done["answered"] == 200, (done, _logs(fleet))
    records = wait_records(fleet.records, 200)
    assert len(records) == 200, _logs(fleet)
    assert len({r["record_id"] if "record_id" in r else r["trace_id"] for r in records}) == 200
    # Both replicas wrote theirs, into the one volume.
    assert len({r["host"] for r in records}) == 2
    # One API key, one fingerprint, whichever replica hashed it: the attribution key from the Secret.
    fingerprints = {(r.get("attribution") or {}).get("api_key") for r in records}
    assert len(fingerprints) == 1 and None not in fingerprints, fingerprints


def test_probes_answer_and_the_admin_token_is_the_secrets(fleet: Fleet) -> None:
    for url in fleet.urls(9464):
        assert fleet.pods.client("get", f"{url}/healthz")["status"] == 200
        assert fleet.pods.client("get", f"{url}/readyz")["status"] == 200
        # Beyond the pod's loopback, the span receiver asks the token the chart keeps in its Secret.
        assert fleet.pods.client("post", f"{url}/v1/traces")["status"] == 401
        assert fleet.pods.client("post", f"{url}/v1/traces", "not-the-token-0123456789")["status"] in (401, 403)
        token = fleet.values["admin"]["token"]
        assert fleet.pods.client("post", f"{url}/v1/traces", token)["status"] not in (401, 403)


def test_the_collector_health_check_answers_on_the_pods_address(fleet: Fleet) -> None:
    for ip in fleet.replicas.values():
        assert fleet.pods.client("get", f"http://{ip}:13133/")["status"] == 200


def test_a_restarted_replica_keeps_the_fingerprint(fleet: Fleet) -> None:
    name = sorted(fleet.replicas)[0]
    before = {(r.get("attribution") or {}).get("api_key") for r in written(fleet.records)}
    fleet.pods.podman("restart", "-t", str(fleet.grace), f"{name}-llmtap", timeout=fleet.grace + 60)
    url = f"http://{fleet.replicas[name]}"
    fleet.pods.wait_http(f"{url}:9464/readyz", 90)
    count = len(written(fleet.records))
    assert fleet.pods.client("drive", f"{url}:8080", "10", KEY)["answered"] == 10
    after = wait_records(fleet.records, count + 10)
    fingerprints = {(r.get("attribution") or {}).get("api_key") for r in after}
    assert fingerprints == before and len(fingerprints) == 1, (before, fingerprints)


def test_a_graceful_stop_finishes_20_streams_and_flushes_within_the_grace_period(fleet: Fleet) -> None:
    name = sorted(fleet.replicas)[-1]
    url = f"http://{fleet.replicas[name]}:8080"
    count = len(written(fleet.records))
    # 20 streams of 1,500 tokens (about 5 s each on the simulator's fast profile), the stop in their midst.
    streams = fleet.pods.client_in_background("streams", url, "20", KEY, "1500")
    time.sleep(2.0)
    started = time.monotonic()
    fleet.pods.podman("stop", "-t", str(fleet.grace), f"{name}-llmtap", timeout=fleet.grace + 60)
    took = time.monotonic() - started
    out, err = streams.communicate(timeout=120)
    result = json.loads(out.strip().splitlines()[-1])
    state = fleet.pods.podman("inspect", "--format", "{{.State.ExitCode}}", f"{name}-llmtap").stdout.strip()
    print(f"graceful stop: {took:.1f} s of a {fleet.grace} s grace period; streams {result}; exit code {state}")
    assert result["whole"] == 20, (result, err, fleet.pods.logs(f"{name}-llmtap"))
    assert took < fleet.grace and state == "0", (took, state, fleet.pods.logs(f"{name}-llmtap"))
    # Nothing lost: the 20 streams' records are on the volume once the process has exited.
    assert len(wait_records(fleet.records, count + 20, 10)) == count + 20


def test_llmtap_as_the_model_servers_sidecar(fleet: Fleet) -> None:
    """``modelServer``: the simulator in llmtap's pod, reached over the pod's loopback, llmtap on one core."""
    pods, run_id = fleet.pods, f"{fleet.pods.run_id}-side"
    values = {
        "fullnameOverride": run_id,
        "replicaCount": 1,
        "image": {**fleet.values["image"]},
        "modelServer": {
            "enabled": True,
            "image": fleet.values["image"]["repository"] + ":" + fleet.values["image"]["tag"],
            "command": ["llmtap", "simulate", "--host", "127.0.0.1", "--port", "8000", "--profile", "fast"],
            "port": 8000,
            "provider": "openai",
        },
        "resources": {"limits": {"cpu": "1", "memory": "512Mi"}},
        "topologySpread": {"enabled": False},
    }
    rendered = manifests(values)
    _volumes(pods, rendered, run_id)
    docs = playable(rendered, run_id, NAMESPACE)
    (name,) = pods.play(docs)
    ip = pods.address(name)
    pods.wait_http(f"http://{ip}:9464/readyz", 90)
    done = pods.client("drive", f"http://{ip}:8080", "20", KEY)
    assert done["answered"] == 20, (done, pods.logs(f"{name}-llmtap"), pods.logs(f"{name}-model-server"))
    # The model server listens on the pod's loopback only: beyond the pod, llmtap is the way in.
    assert pods.client("get", f"http://{ip}:8000/v1/models")["status"] == 0
    cpus = pods.podman("inspect", "--format", "{{.HostConfig.NanoCpus}}", f"{name}-llmtap").stdout.strip()
    assert cpus in ("1000000000", "0"), cpus  # one core where podman applies the limit
    assert yaml.safe_load(by_kind(rendered)["ConfigMap"][0]["data"]["llmtap.yaml"])["routes"][0]["upstream"] == (
        "http://127.0.0.1:8000"
    )
