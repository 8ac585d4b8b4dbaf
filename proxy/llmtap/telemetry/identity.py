"""Who wrote a record: the process's instance id (its OTel ``service.instance.id``), host, pid and llmtap version.

A fleet's records are read as one dataset, so each record says which process wrote it. The instance id is the
one the process's telemetry carries as ``service.instance.id`` (``OTEL_RESOURCE_ATTRIBUTES``) when one is set;
else host name, pid and start time, which no other process shares.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from llmtap import __version__

__all__ = ["INSTANCE_KEY", "RESOURCE_ENV", "Identity", "configured_instance_id", "current", "own_instance_id"]

RESOURCE_ENV = "OTEL_RESOURCE_ATTRIBUTES"
INSTANCE_KEY = "service.instance.id"


@dataclass(frozen=True, slots=True)
class Identity:
    """The writer of a record."""

    instance_id: str
    host: str
    pid: int
    version: str = __version__


def own_instance_id(host: str | None = None, pid: int | None = None, started: float | None = None) -> str:
    """Host name, pid and start time (milliseconds, hex): unique per process."""
    host = host or socket.gethostname() or "localhost"
    pid = os.getpid() if pid is None else pid
    started = time.time() if started is None else started
    return f"{host}-{pid}-{int(started * 1000):x}"


def configured_instance_id(env: dict[str, str] | None = None) -> str | None:
    """The ``service.instance.id`` set in ``OTEL_RESOURCE_ATTRIBUTES`` (the last one wins, as in the SDK), if any."""
    raw = (os.environ if env is None else env).get(RESOURCE_ENV, "")
    found = None
    for item in raw.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip() == INSTANCE_KEY and value.strip():
            found = value.strip()
    return found


_own: dict[int, str] = {}


def current() -> Identity:
    """This process's identity: the configured instance id, else one made once per process."""
    pid = os.getpid()
    instance = configured_instance_id()
    if instance is None:
        instance = _own.setdefault(pid, own_instance_id(pid=pid))
    return Identity(instance_id=instance, host=socket.gethostname() or "localhost", pid=pid)
