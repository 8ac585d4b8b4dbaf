"""Playing the rendered chart as pods with ``podman kube play`` (podman 4.3), for tests/deploy/test_pods.py.

Everything runs in a network namespace of its own (``ip netns``), so whatever the pods listen on, and the ports
kube play publishes for every containerPort, stay inside it: nothing listens beyond the host's loopback. podman
is entered into it with ``nsenter --net`` (``ip netns exec`` would remount /sys and hide the cgroups podman needs).

What kube play 4.3 cannot take as Kubernetes would, ``playable`` turns into what it can, and says why:
- Secrets: its own Secret import stores YAML that its ``secretKeyRef`` then cannot read, so each Secret is made
  beforehand with ``podman secret create`` in the form the lookup reads (a JSON map of base64 values);
- ``fieldRef metadata.namespace`` is refused: the release's namespace is written in;
- readiness probes are dropped and named probe ports resolve to 0: the probes go, and the test asks them itself;
- every containerPort is published, so two replicas would collide on one port: the ports go (the pods are reached
  by their own addresses, as a Service's endpoints are);
- an emptyDir is one named volume shared by every pod and every run: each gets this run's name;
- Services, ServiceAccounts, HPAs, PDBs and the prometheus-operator kinds are not played.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
#: podman as this host runs it: runc (crun refuses its cgroups) and rlimits within the host's.
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
"""
PLAYED = {"Deployment", "Pod", "ConfigMap"}


class _Dumper(yaml.SafeDumper):
    """YAML kube play's parser reads: a text of several lines as a literal block, not a folded quoted scalar."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


class Pods:
    """podman in a network namespace of this run's own; what it made, removed by ``close``."""

    def __init__(self, run_id: str, workdir: Path) -> None:
        self.run_id = run_id
        self.netns = f"llmtap-{run_id}"
        self.workdir = workdir
        conf = workdir / "containers.conf"
        conf.write_text(CONTAINERS_CONF, encoding="utf-8")
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        self.secrets: list[str] = []
        self.volumes: list[str] = []
        self.pods: list[str] = []
        subprocess.run(["ip", "netns", "add", self.netns], check=True, timeout=30)
        subprocess.run(["ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up"], check=True, timeout=30)

    def podman(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        """One podman command inside the namespace."""
        argv = ["nsenter", f"--net=/run/netns/{self.netns}", "podman", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: {done.stdout}{done.stderr}")
        return done

    def client(self, *args: str, timeout: float = 300) -> dict[str, Any]:
        """tests/support/pods_client.py inside the namespace: its JSON answer."""
        argv = ["nsenter", f"--net=/run/netns/{self.netns}", sys.executable, "-m", "tests.support.pods_client", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    def client_in_background(self, *args: str) -> subprocess.Popen[str]:
        """The same, started now and read later (``communicate``)."""
        argv = ["nsenter", f"--net=/run/netns/{self.netns}", sys.executable, "-m", "tests.support.pods_client", *args]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    def secret(self, name: str, data: Mapping[str, str]) -> None:
        """A Secret as kube play's ``secretKeyRef`` reads it: a JSON map of base64 values (``data`` is base64)."""
        path = self.workdir / f"secret-{name}.json"
        path.write_text(json.dumps(dict(data)), encoding="utf-8")
        self.podman("secret", "create", name, str(path))
        self.secrets.append(name)
        path.unlink()

    def volume(self, name: str, uid: int) -> Path:
        """A named volume the pods' user can write (Kubernetes' fsGroup, which kube play leaves out)."""
        self.podman("volume", "create", name)
        self.volumes.append(name)
        mountpoint = Path(self.podman("volume", "inspect", "--format", "{{.Mountpoint}}", name).stdout.strip())
        os.chown(mountpoint, uid, uid)
        return mountpoint

    def play(self, docs: Iterable[Mapping[str, Any]]) -> list[str]:
        """kube play the documents; the pods it started (kept for ``close``)."""
        path = self.workdir / f"play-{len(self.pods)}.yaml"
        path.write_text(yaml.dump_all(list(docs), Dumper=_Dumper), encoding="utf-8")
        done = self.podman("kube", "play", str(path), timeout=300)
        started = [line.split()[-1] for line in done.stdout.splitlines() if line.startswith("Pod:")]
        names = self.podman("pod", "ps", "--format", "{{.Name}}", "--filter", f"name={self.run_id}").stdout.split()
        new = [n for n in names if n not in self.pods]
        self.pods += new
        assert new, done.stdout + done.stderr + str(started)
        return sorted(new)

    def address(self, pod: str) -> str:
        """A pod's address on podman's network (its infra container's)."""
        infra = self.podman("pod", "inspect", "--format", "{{.InfraContainerID}}", pod).stdout.strip()
        fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
        return self.podman("inspect", "--format", fmt, infra).stdout.strip()

    def wait_http(self, url: str, deadline_s: float) -> None:
        """Until ``url`` answers 200 (the start of llmtap, its tokenizer loaded), at most ``deadline_s``."""
        deadline = time.monotonic() + deadline_s
        while True:
            if self.client("get", url, timeout=30)["status"] == 200:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} did not answer 200 within {deadline_s} s")
            time.sleep(0.5)

    def logs(self, container: str) -> str:
        """A container's output, for a failure's message."""
        done = self.podman("logs", container, check=False)
        return (done.stdout + done.stderr)[-4000:]

    def close(self) -> None:
        """Remove every pod, secret and volume of this run, and the namespace; never raises."""
        for pod in self.pods:
            self.podman("pod", "rm", "-f", "-t", "0", pod, check=False, timeout=120)
        for secret in self.secrets:
            self.podman("secret", "rm", secret, check=False)
        # The volumes made here, and those kube play made for the ConfigMaps (named after them: this run's names).
        made = self.podman("volume", "ls", "--format", "{{.Name}}", "--filter", f"name={self.run_id}", check=False)
        for volume in {*self.volumes, *made.stdout.split()}:
            self.podman("volume", "rm", "-f", volume, check=False)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)


def missing_tools() -> list[str]:
    """What playing pods needs and this machine lacks."""
    out = [tool for tool in ("podman", "runc", "nsenter", "ip") if shutil.which(tool) is None]
    if shutil.which("catatonit") is None and not Path("/usr/libexec/podman/catatonit").exists():
        out.append("catatonit")
    if os.geteuid() != 0:
        out.append("root (network namespaces)")
    return out


def playable(docs: Iterable[Mapping[str, Any]], run_id: str, namespace: str) -> list[dict[str, Any]]:
    """The rendered manifests as kube play 4.3 takes them (the module's docstring says what changes and why)."""
    out = []
    for doc in docs:
        if doc["kind"] not in PLAYED:
            continue
        doc = json.loads(json.dumps(doc))
        spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc.get("spec")
        if spec is not None:
            _pod_spec(spec, run_id, namespace)
        out.append(doc)
    return out


def _pod_spec(spec: dict[str, Any], run_id: str, namespace: str) -> None:
    renamed = {}
    for volume in spec.get("volumes", []):
        if "emptyDir" in volume:
            renamed[volume["name"]] = volume["name"] = f"{run_id}-{volume['name']}"
    for container in spec["containers"]:
        for key in ("ports", "readinessProbe", "livenessProbe", "lifecycle"):
            container.pop(key, None)
        for mount in container.get("volumeMounts", []):
            mount["name"] = renamed.get(mount["name"], mount["name"])
        for variable in container.get("env", []):
            field = variable.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if field == "metadata.namespace":
                variable.pop("valueFrom")
                variable["value"] = namespace


def secrets_of(docs: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """The rendered Secrets: name -> their base64 data."""
    return {d["metadata"]["name"]: dict(d["data"]) for d in docs if d["kind"] == "Secret"}


def b64(text: str) -> str:
    """A Secret's value as its ``data`` holds it."""
    return base64.b64encode(text.encode()).decode()
