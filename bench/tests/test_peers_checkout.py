"""The benchmark measures the llmtap of the checkout it runs from, and nginx speaks upstream TLS as llmtap does."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from bench import peers, tlsca
from tests.conftest import require_real


def test_llmtap_processes_import_this_checkouts_llmtap() -> None:
    # An environment whose own install is another checkout's (an editable install of it) must not win.
    done = subprocess.run(
        [sys.executable, "-c", "import llmtap, bench; print(llmtap.__file__); print(bench.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "PYTHONPATH": peers.LLMTAP_PATH},
        cwd="/",
    )
    llmtap_file, bench_file = (Path(line) for line in done.stdout.split())
    assert llmtap_file == peers.REPO / "proxy" / "llmtap" / "__init__.py"
    assert bench_file == peers.REPO / "bench" / "__init__.py"


def test_nginx_speaks_tls_1_3_to_an_https_upstream_as_llmtap_does(tmp_path: Path) -> None:
    require_real(shutil.which("nginx") is not None, "nginx", peers.INSTALL)
    certs = tlsca.make(tmp_path / "tls")
    context = certs.server_context()
    listener = socket.create_server(("127.0.0.1", 0))
    versions: list[str | None] = []

    def serve() -> None:
        raw, _ = listener.accept()
        with context.wrap_socket(raw, server_side=True) as sock:
            versions.append(sock.version())
            sock.recv(65536)
            sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    nginx = peers.nginx(tmp_path, None, listener.getsockname()[1], certs=certs)
    try:
        with urllib.request.urlopen(nginx.url, timeout=30) as answer:
            assert answer.read() == b"ok"
    finally:
        assert nginx.service is not None
        nginx.service.stop()
        listener.close()
    thread.join(10)
    assert versions == ["TLSv1.3"]
