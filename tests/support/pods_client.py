"""The clients of tests/deploy/test_pods.py, run inside the pods' network namespace
(``python -m tests.support.pods_client``).

The pods' addresses exist only in a namespace of their own (nothing of theirs listens on the host), so the test
runs this module there with ``nsenter --net=...``; it prints one JSON line of what it saw. Standard library only.

    drive URL[,URL...] N KEY       N streamed chat completions spread over the URLs, 16 at a time
    streams URL N KEY TOKENS       N long streams at once, each to its end
    get URL [TOKEN]                one GET: the status
    post URL [TOKEN]               one empty OTLP POST: the status
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout), parts.path or "/"


def chat(base: str, key: str, max_tokens: int) -> dict[str, object]:
    """One streamed chat completion read to its end: status, whether [DONE] came, and its seconds."""
    started = time.monotonic()
    body = json.dumps(
        {
            "stream": True,  # no model: the simulator, as vLLM, serves its only one
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Say something about pods."}],
        }
    )
    try:
        conn, _ = _connection(base, 60)
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=body,
            headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
        )
        response = conn.getresponse()
        data = response.read()
        conn.close()
    except OSError as exc:
        return {"status": 0, "done": False, "error": str(exc), "seconds": time.monotonic() - started}
    done = b"data: [DONE]" in data
    return {"status": response.status, "done": done, "seconds": time.monotonic() - started}


def drive(urls: list[str], n: int, key: str) -> dict[str, object]:
    """``n`` requests, round robin over ``urls`` (the Service's balancing, done here), 16 in flight."""
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: chat(urls[i % len(urls)], key, 16), range(n)))
    answered = sum(1 for r in results if r["status"] == 200 and r["done"])
    return {"answered": answered, "failed": [r for r in results if not (r["status"] == 200 and r["done"])][:5]}


def streams(url: str, n: int, key: str, tokens: int) -> dict[str, object]:
    """``n`` long streams at once: how many finished whole, and the longest."""
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda _: chat(url, key, tokens), range(n)))
    whole = sum(1 for r in results if r["status"] == 200 and r["done"])
    longest = max(float(str(r["seconds"])) for r in results)
    return {"whole": whole, "longest": longest, "failed": [r for r in results if not r["done"]][:5]}


def request(method: str, url: str, token: str | None) -> dict[str, object]:
    """One GET or empty OTLP POST: its status (0 when refused)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if method == "POST":
        headers["content-type"] = "application/x-protobuf"
    try:
        conn, path = _connection(url, 10)
        conn.request(method, path, body=b"" if method == "POST" else None, headers=headers)
        status = conn.getresponse().status
        conn.close()
    except OSError as exc:
        return {"status": 0, "error": str(exc)}
    return {"status": status}


def main(argv: list[str]) -> None:
    """Run one command; print its JSON line."""
    command, args = argv[0], argv[1:]
    if command == "drive":
        out = drive(args[0].split(","), int(args[1]), args[2])
    elif command == "streams":
        out = streams(args[0], int(args[1]), args[2], int(args[3]))
    else:
        out = request(command.upper(), args[0], args[1] if len(args) > 1 else None)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
