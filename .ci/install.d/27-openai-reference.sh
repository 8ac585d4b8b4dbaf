#!/usr/bin/env bash
# Installs the independent reference for tests/real/test_reference_openai.py into its own virtual environment
# ("$LLMTAP_TOOLS/openai-reference"): the `openai` SDK under the official OpenTelemetry instrumentation,
# opentelemetry-instrumentation-openai-v2. The set is pinned to versions that import together: the
# instrumentation reads the SDK's base URL as an httpx URL, so `openai` stays on 2.x (3.x moved to httpx2,
# and the test extra has it); opentelemetry-util-genai 1.2b0 and later no longer ship the module the
# instrumentation imports. Idempotent: a venv whose pins import is kept. About 20 seconds, 80 MB.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
tools="${LLMTAP_TOOLS:-$repo/.tools}"
venv="$tools/openai-reference"
pins=(
    "openai==2.54.0"
    "opentelemetry-instrumentation-openai-v2==2.4b0"
    "opentelemetry-util-genai==1.1b0"
    "opentelemetry-instrumentation==0.66b2"
    "opentelemetry-sdk==1.45.2"
    "opentelemetry-exporter-otlp-proto-http==1.45.2"
)
check='
import importlib.metadata as md, sys
from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
want = dict(p.split("==") for p in sys.argv[1:])
have = {name: md.version(name) for name in want}
sys.exit(0 if have == want else f"installed {have}, pinned {want}")
'

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" "${pins[@]}" >/dev/null 2>&1; then
    exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "${pins[@]}"
"$venv/bin/python" -c "$check" "${pins[@]}"
