"""A small client of the Prometheus HTTP API: instant queries, and counter growth between two moments.

The query text and the arithmetic over the answers are ``llmtap.analysis.promql``'s; this sends them.
"""

from __future__ import annotations

import re

import httpx

from llmtap.analysis.promql import Grown, growth, keyed
from llmtap.config.types import ConfigError

__all__ = ["Prometheus"]


class Prometheus:
    """Instant queries against a Prometheus server's HTTP API (``/api/v1/query``)."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        if not re.match(r"https?://[^/]+", url):
            raise ConfigError(f"--prometheus: {url!r} is not an http(s) URL")
        self.url = url.rstrip("/")
        self._client = httpx.Client(timeout=timeout)

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def query(self, expr: str, at: float) -> list[tuple[dict[str, str], float]]:
        """The instant vector of ``expr`` at ``at`` (epoch seconds), as (labels, value) pairs."""
        try:
            response = self._client.get(f"{self.url}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"})
        except httpx.HTTPError as exc:
            raise ConfigError(f"Prometheus at {self.url} is not reachable ({type(exc).__name__}: {exc})") from None
        try:
            body = response.json()
        except ValueError:
            raise ConfigError(f"Prometheus at {self.url} answered HTTP {response.status_code}, not its API") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error") if isinstance(body, dict) else None
            raise ConfigError(f"Prometheus at {self.url} refused the query: {error or response.status_code}")
        data = body.get("data")
        result = data.get("result") if isinstance(data, dict) else None
        out = []
        for item in result if isinstance(result, list) else ():
            try:
                out.append((dict(item["metric"]), float(item["value"][1])))
            except (KeyError, IndexError, TypeError, ValueError):
                continue
        return out

    def increase(self, expr: str, start: float | None, end: float) -> Grown:
        """What the counters in ``expr`` grew by from ``start`` to ``end`` (from their beginning when None)."""
        last = keyed(self.query(expr, end))
        return growth(None if start is None else keyed(self.query(expr, start)), last)
