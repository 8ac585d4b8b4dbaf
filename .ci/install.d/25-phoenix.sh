#!/usr/bin/env bash
# Installs Arize Phoenix, a real OTLP trace backend, into its own virtual environment ("$LLMTAP_TOOLS/phoenix"):
# its many pins must not meet ours. tests/real/test_phoenix.py starts `phoenix serve` offline from there.
# Idempotent: a venv that already has arize-phoenix and its `phoenix` command is kept. About 2 minutes, 850 MB.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
tools="${LLMTAP_TOOLS:-$repo/.tools}"
venv="$tools/phoenix"

if [ -x "$venv/bin/phoenix" ] && "$venv/bin/python" -m pip show --quiet arize-phoenix >/dev/null 2>&1; then
    exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "arize-phoenix>=20,<21"
"$venv/bin/phoenix" --help >/dev/null
