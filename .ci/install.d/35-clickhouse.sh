#!/usr/bin/env bash
# Installs ClickHouse (Debian's package, 18.16: clickhouse-server and clickhouse-client) for the real tier:
# the record sink (`serve --record-clickhouse URL`) and `llmtap compare/slo --clickhouse URL`. The tests start
# it as a plain process on free ports with a generated config (tests/support/clickhouse_server.py); no systemd here.
# A current ClickHouse is checked too, embedded: chDB from PyPI (the `test` extra). Idempotent: an installed
# clickhouse-server is kept.
set -euo pipefail
if command -v clickhouse-server >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
# Read whole before it is searched: `grep -q` stops at its match, and under pipefail the writer's SIGPIPE
# would fail the test that just succeeded.
policy=$(apt-cache policy clickhouse-server)
if ! grep -q 'Candidate: [0-9]' <<<"$policy"; then
    echo "35-clickhouse: no clickhouse-server package in this system's apt sources" >&2
    echo "$policy" >&2
    exit 1
fi
apt-get install -y -qq --no-install-recommends clickhouse-server clickhouse-client >/dev/null
# The package's own service is not wanted: the tests run their servers with their own config and data.
if command -v service >/dev/null 2>&1; then
    service clickhouse-server stop >/dev/null 2>&1 || true
fi
clickhouse-client --version
