#!/usr/bin/env bash
# Installs Prometheus (Debian's package, 2.42, with promtool) for the real tier: the tests and the
# benchmark that scrape the proxy's /metrics and query them back (dashboards, `llmtap compare --prometheus`).
# It runs there as a plain process (no systemd here). Idempotent: an installed prometheus binary is kept.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
