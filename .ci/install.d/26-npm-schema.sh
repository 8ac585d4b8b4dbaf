#!/usr/bin/env bash
# Derives the Grafana dashboard JSON Schema from npm's @grafana/schema (its TypeScript `Dashboard` type, through
# ts-json-schema-generator) into "$LLMTAP_TOOLS/npm/dashboard-<version>.schema.json"; tests/project/test_dashboards.py
# validates every generated dashboard against it. Derived here rather than checked in: the file is a pure function
# of the pinned package, so bumping GRAFANA_SCHEMA below is the whole upgrade, and no stale copy can linger.
# Idempotent: a schema already derived for this version is kept.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
tools="${LLMTAP_TOOLS:-$repo/.tools}"
dir="$tools/npm"
GRAFANA_SCHEMA=13.2.3
# 2.4.0 is the newest generator that runs on Debian 12's Node 20.
GENERATOR=2.4.0
TYPESCRIPT=5.8.3
out="$dir/dashboard-$GRAFANA_SCHEMA.schema.json"

if [ -s "$out" ]; then
    exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
mkdir -p "$dir"
cd "$dir"
[ -f package.json ] || echo '{"name": "llmtap-tools", "private": true}' > package.json
npm install --silent --no-audit --no-fund --save-exact \
    "@grafana/schema@$GRAFANA_SCHEMA" "ts-json-schema-generator@$GENERATOR" "typescript@$TYPESCRIPT" >/dev/null
npx --no-install ts-json-schema-generator \
    --path node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts \
    --type Dashboard --no-type-check --additional-properties -o "$out.part" >/dev/null
mv "$out.part" "$out"
