"""A real ClickHouse server for the tests: Debian's ``clickhouse-server`` run as a plain process.

Its config is generated into a temporary directory (data, logs, every port: HTTP, native TCP and
interserver, each a free one of 127.0.0.1), so it never meets the package's own service or another test's
server. Two users: ``default`` without a password and ``llmtap`` with ``PASSWORD``.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import PATIENCE, require_real
from tests.support.net import free_port
from tests.support.procs import stop

USER = "llmtap"
PASSWORD = "s3cret-for-tests"
#: How a machine without it gets the server (what a real tier that cannot run says).
HOW = "apt-get install clickhouse-server clickhouse-client (.ci/install.d/35-clickhouse.sh)"

_CONFIG = """<?xml version="1.0"?>
<yandex>
  <logger>
    <level>warning</level>
    <log>{dir}/log/server.log</log>
    <errorlog>{dir}/log/server.err.log</errorlog>
  </logger>
  <http_port>{http}</http_port>
  <tcp_port>{tcp}</tcp_port>
  <interserver_http_port>{interserver}</interserver_http_port>
  <listen_host>127.0.0.1</listen_host>
  <path>{dir}/data/</path>
  <tmp_path>{dir}/tmp/</tmp_path>
  <user_files_path>{dir}/user_files/</user_files_path>
  <format_schema_path>{dir}/format_schemas/</format_schema_path>
  <mark_cache_size>67108864</mark_cache_size>
  <uncompressed_cache_size>67108864</uncompressed_cache_size>
  <max_concurrent_queries>20</max_concurrent_queries>
  <timezone>UTC</timezone>
  <users_config>{dir}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
</yandex>
"""

_USERS = """<?xml version="1.0"?>
<yandex>
  <profiles><default><max_threads>2</max_threads></default></profiles>
  <users>
    <default>
      <password></password>
      <networks><ip>127.0.0.1</ip></networks>
      <profile>default</profile>
      <quota>default</quota>
    </default>
    <{user}>
      <password>{password}</password>
      <networks><ip>127.0.0.1</ip></networks>
      <profile>default</profile>
      <quota>default</quota>
    </{user}>
  </users>
  <quotas><default></default></quotas>
</yandex>
"""


def installed() -> bool:
    """Whether Debian's clickhouse-server is on this machine."""
    return shutil.which("clickhouse-server") is not None


class ClickHouseProcess:
    """One clickhouse-server with its own directory and free ports; ``start`` waits until it answers."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.http_port = free_port()
        self.tcp_port = free_port()
        self.interserver_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        for sub in ("data", "tmp", "log", "user_files", "format_schemas"):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        (directory / "config.xml").write_text(
            _CONFIG.format(dir=directory, http=self.http_port, tcp=self.tcp_port, interserver=self.interserver_port)
        )
        (directory / "users.xml").write_text(_USERS.format(user=USER, password=PASSWORD))

    @property
    def url(self) -> str:
        """The HTTP interface's base URL."""
        return f"http://127.0.0.1:{self.http_port}/"

    def start(self, patience: float) -> None:
        """Start the server and wait (up to ``patience`` seconds) until it answers ``SELECT 1``."""
        stdout = (self.dir / "log" / "stdout").open("ab")
        self.proc = subprocess.Popen(
            ["clickhouse-server", f"--config-file={self.dir / 'config.xml'}"],
            stdout=stdout,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            start_new_session=True,
        )
        stdout.close()
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"clickhouse-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                if self.query("SELECT 1").strip() == "1":
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"clickhouse-server did not answer within {patience:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 20 s) and wait for it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        stop(self.proc, grace=20)

    def query(self, sql: str, *, user: str | None = None, password: str | None = None) -> str:
        """Run ``sql`` over HTTP as ``default`` (or ``user``); the answer as text."""
        params = {"query": sql}
        if user is not None:
            params |= {"user": user, "password": password or ""}
        url = self.url + "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=30) as r:
            return str(r.read().decode())

    def count(self, table: str) -> int:
        """The rows of ``table``."""
        return int(self.query(f"SELECT count() FROM {table}").strip())

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server's error log and stdout, for a failed start."""
        out: list[str] = []
        for name in ("server.err.log", "stdout"):
            path = self.dir / "log" / name
            if path.exists():
                out += path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(out)


@contextlib.contextmanager
def started(directory: Path) -> Iterator[ClickHouseProcess]:
    """A server in ``directory``, answering, stopped on the way out; a real tier that cannot run says why
    (``require_real``): what a test module's ``server`` fixture yields."""
    require_real(installed(), "ClickHouse (clickhouse-server)", HOW)
    proc = ClickHouseProcess(directory)
    proc.start(PATIENCE)
    try:
        yield proc
    finally:
        proc.stop()
