"""llmtap's image (Containerfile) as `.ci/image.sh` builds it, run as a cluster would run it.

Read-only root, no network, nothing writable but a tmpfs /tmp and, where it keeps its state, a volume: `llmtap
demo` prints its tables and verdicts, `llmtap serve` (the image's default command) answers its health check and
keeps the attribution key on the volume. The image runs as a numeric non-root user, holds no compiler, carries
the OCI labels with the package's one version, and stays under the size the issue sets.
"""

from __future__ import annotations

import re
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.commands.test_demo_output import table
from tests.conftest import PATIENCE, require_real
from tests.support import podman as pm

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
#: The serve image's size at most, in bytes as podman counts them.
TARGET_BYTES = 250_000_000
#: How the tests run a container: a read-only root and no network; /tmp a tmpfs; no capability, no privilege.
LOCKED = (
    *("--read-only", "--network", "none", "--tmpfs", "/tmp:rw,size=64m"),
    *("--cap-drop", "ALL", "--security-opt", "no-new-privileges"),
)

#: A duration as the demo prints it: ms below a second, else seconds (a busy machine's TTFT can pass a second).
DURATION = r"(?:\d+ ms|\d+\.\d\d s)"

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def image() -> str:
    tag = pm.image_tag()
    require_real(pm.available(tag), f"llmtap's image {tag} (podman)", "bash .ci/image.sh")
    return tag


def inspect(image: str, field: str) -> str:
    return pm.podman("image", "inspect", "--format", f"{{{{{field}}}}}", image).stdout.strip()


def test_the_tag_is_the_packages_version() -> None:
    assert pm.image_tag() == f"localhost/llmtap:{PROJECT['version']}"


def test_llmtap_demo_runs_with_a_read_only_root_and_no_network(image: str) -> None:
    run = pm.podman("run", "--rm", *LOCKED, image, "demo", timeout=PATIENCE * 3)
    assert run.returncode == 0, run.stderr
    both = run.stdout + run.stderr
    assert "Traceback" not in both and "Read-only file system" not in both, both
    for workload in ("support assistant", "code completion"):
        groups, stats, rows = table(run.stdout, workload)
        assert groups[:3] == ["TTFT", "ITL", "TPOT"] and stats[:3] == ["layout", "p50", "p95"]
        assert set(rows) == {"variable-first", "fixed-first"}
        for row in rows.values():
            assert len(row) == len(stats) and re.fullmatch(DURATION, row[1]), row
        # Each workload's verdict; the support assistant's gain (-84% in the course) is beyond a busy machine's noise.
        verdict = rf"^{workload}: (caching gain: TTFT p50 {DURATION} to {DURATION}|no significant gain|no verdict)"
        found = re.search(verdict, run.stdout, re.M)
        assert found and (workload != "support assistant" or "caching gain" in found.group(1)), run.stdout
    assert re.search(r"^Request records: /tmp/llmtap-demo-\S+/records$", run.stdout, re.M), run.stdout


def test_it_runs_as_a_numeric_non_root_user(image: str) -> None:
    # Kubernetes' runAsNonRoot can verify a numeric user only.
    user = inspect(image, ".Config.User")
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), user
    run = pm.podman("run", "--rm", "--entrypoint", "id", image, "-u")
    assert run.stdout.strip() == user.split(":")[0] != "0"


def test_no_compiler_in_the_image(image: str) -> None:
    probe = "for c in python3 gcc cc c++ g++ clang tcc as ld strip make; do command -v $c || true; done"
    found = pm.podman("run", "--rm", "--entrypoint", "sh", image, "-c", probe).stdout.split()
    assert found and found[0].endswith("/python3"), found  # the probe finds what is there
    assert found[1:] == [], found


def test_the_labels_and_the_version_are_the_packages(image: str) -> None:
    labels = {
        key.removeprefix("org.opencontainers.image."): inspect(image, f'index .Labels "{key}"')
        for key in (f"org.opencontainers.image.{k}" for k in ("version", "title", "licenses", "description"))
    }
    assert labels == {
        "version": PROJECT["version"],
        "title": PROJECT["name"],
        "licenses": PROJECT["license"],
        "description": PROJECT["description"],
    }
    run = pm.podman("run", "--rm", *LOCKED, image, "--version")
    assert run.stdout.strip() == f"llmtap {PROJECT['version']}", run
    # The licence's text travels with the installed package, as in the wheel.
    probe = "import importlib.metadata as m; print(m.distribution('llmtap').read_text('licenses/LICENSE'))"
    run = pm.podman("run", "--rm", *LOCKED, "--entrypoint", "python", image, "-c", probe)
    assert run.stdout.strip() == (ROOT / "LICENSE").read_text(encoding="utf-8").strip(), run.stderr


def test_the_serve_image_is_under_the_target_and_has_no_analysis_extra(image: str) -> None:
    size = int(inspect(image, ".Size"))
    assert 0 < size <= TARGET_BYTES, f"{size / 1e6:.0f} MB"
    probe = "import importlib.util as u; print([m for m in ('duckdb', 'numpy', 'pip') if u.find_spec(m)])"
    run = pm.podman("run", "--rm", *LOCKED, "--entrypoint", "python", image, "-c", probe)
    assert run.stdout.strip() == "[]", run


@pytest.fixture
def volume() -> Iterator[str]:
    name = f"llmtap-test-{uuid.uuid4().hex[:12]}"
    pm.podman("volume", "create", name)
    yield name
    pm.podman("volume", "rm", "--force", name, check=False)


def serve(image: str, *volume: str) -> tuple[str, str]:
    """Start the image's default command (serve) read-only, wait for /healthz from inside; its log so far."""
    name = f"llmtap-test-{uuid.uuid4().hex[:12]}"
    mount = ("--volume", f"{volume[0]}:/var/lib/llmtap") if volume else ()
    pm.podman("run", "--detach", "--name", name, *LOCKED, *mount, "--env", "LLMTAP_UPSTREAM=http://127.0.0.1:9", image)
    health = "import urllib.request as r; print(r.urlopen('http://127.0.0.1:9464/healthz', timeout=5).status)"
    deadline = time.monotonic() + PATIENCE
    while True:
        probe = pm.podman("exec", name, "python", "-c", health, check=False)
        if probe.stdout.strip() == "200":
            break
        running = inspect_container(name, ".State.Running")
        if running != "true" or time.monotonic() > deadline:
            log = pm.podman("logs", name, check=False)
            pm.podman("rm", "--force", name, check=False)
            pytest.fail(f"serve did not answer /healthz (running: {running}): {log.stdout}{log.stderr}")
        time.sleep(0.5)
    # A request that carries an API key: the relay makes (or reads) the install's secret for its fingerprint.
    ask = (
        "import urllib.request as r, urllib.error as e\n"
        "q = r.Request('http://127.0.0.1:8080/v1/chat/completions', data=b'{}',\n"
        "              headers={'Authorization': 'Bearer k'})\n"
        "try: r.urlopen(q, timeout=30)\n"
        "except e.HTTPError as x: print(x.code)"
    )
    answer = pm.podman("exec", name, "python", "-c", ask, check=False)
    assert answer.stdout.strip() == "502", answer  # the upstream is nowhere: the proxy says so
    key = pm.podman("exec", name, "cat", "/var/lib/llmtap/state/llmtap/attribution.key", check=False).stdout
    stop = pm.podman("stop", "--time", "30", name, check=False)
    log = pm.podman("logs", name, check=False)
    status = inspect_container(name, ".State.ExitCode")
    pm.podman("rm", "--force", name, check=False)
    assert stop.returncode == 0 and status == "0", (status, log.stderr)
    return key.strip(), log.stdout + log.stderr


def inspect_container(name: str, field: str) -> str:
    return pm.podman("container", "inspect", "--format", f"{{{{{field}}}}}", name, check=False).stdout.strip()


def test_serve_starts_read_only_and_keeps_its_key_on_the_volume(image: str, volume: str) -> None:
    key, log = serve(image, volume)
    assert re.fullmatch(r"[0-9a-f]{64}", key), log
    assert "proxy on http://0.0.0.0:8080" in log and "admin on http://0.0.0.0:9464" in log, log
    assert "Read-only file system" not in log and "Traceback" not in log, log
    again, log = serve(image, volume)
    assert again == key, log  # the same fingerprints after a restart
    # Without the volume, the root is read-only: the process makes its own key, and says so.
    missing, log = serve(image)
    assert missing == "" and "cannot keep a secret in /var/lib/llmtap/state/llmtap/attribution.key" in log, log
