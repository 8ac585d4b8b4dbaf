"""podman as the tests run it: with the containers.conf and the image tag that `.ci/image.sh` says.

`.ci/image.sh` builds llmtap's image (tagged with pyproject.toml's version) and writes the containers.conf podman
runs with on machines like CI's (runc, rlimits within the host's); `--print-tag` and `--print-conf` say which, so
the tests and the script cannot disagree.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["IMAGE_SCRIPT", "available", "env", "image_tag", "podman"]

IMAGE_SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "image.sh"


def _script(flag: str) -> str:
    return subprocess.run(
        ["bash", str(IMAGE_SCRIPT), flag], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


@functools.cache
def image_tag() -> str:
    """The tag `.ci/image.sh` gives the image it builds: ``localhost/llmtap:<version>``."""
    return _script("--print-tag")


@functools.cache
def env() -> dict[str, str]:
    """The environment podman runs in: this one, with CONTAINERS_CONF at the script's file when it made one."""
    conf = _script("--print-conf")
    return {**os.environ, "CONTAINERS_CONF": conf} if Path(conf).is_file() else dict(os.environ)


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``podman ARGS``; its output as text."""
    return subprocess.run(["podman", *args], capture_output=True, text=True, env=env(), timeout=timeout, check=check)


def available(tag: str) -> bool:
    """Whether podman is installed and holds the image ``tag``."""
    if shutil.which("podman") is None:
        return False
    return podman("image", "exists", tag, check=False).returncode == 0
