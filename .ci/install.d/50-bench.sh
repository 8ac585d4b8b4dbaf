#!/usr/bin/env bash
# Installs the peers and the reference client of the benchmark (bench/, bench/tests/test_smoke.py):
# nginx (Debian nginx-light, the floor for a proxy, also over an HTTPS upstream), wrk, LiteLLM's proxy and NVIDIA's aiperf, each of the two
# Python tools in its own virtual environment ("$LLMTAP_TOOLS/litellm", "$LLMTAP_TOOLS/aiperf") because
# their pins clash with ours and with each other.
# Idempotent: what already runs is kept.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
tools="${LLMTAP_TOOLS:-$repo/.tools}"
mkdir -p "$tools"

if ! command -v nginx >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends nginx-light >/dev/null
    # Nothing may keep running from the package's own set-up: the benchmark starts its own nginx.
    if command -v service >/dev/null 2>&1; then
        service nginx stop >/dev/null 2>&1 || true
    fi
fi
command -v nginx >/dev/null
# wrk: the closed-loop load of the requests-per-second part (bench/rps.py).
if ! command -v wrk >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends wrk >/dev/null
fi
command -v wrk >/dev/null
# The HTTPS-upstream scenarios proxy with proxy_pass https:// (nginx-light has the SSL module; say so if not).
case "$(nginx -V 2>&1)" in
    *--with-http_ssl_module*) ;;
    *) echo "nginx lacks http_ssl_module (install nginx-light)" >&2; exit 1 ;;
esac

# venv NAME IMPORT-CHECK PACKAGE...: a virtual environment that passes the check, made anew when it does not.
venv() {
    local dir="$tools/$1" check="$2"
    shift 2
    if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "$check" >/dev/null 2>&1; then
        return 0
    fi
    rm -rf "$dir"
    python3 -m venv "$dir"
    "$dir/bin/python" -m pip install --quiet --upgrade pip
    "$dir/bin/python" -m pip install --quiet "$@"
    "$dir/bin/python" -c "$check"
}

# Importing LiteLLM fetches a price list from the network unless told to use its bundled copy.
export LITELLM_LOCAL_MODEL_COST_MAP=True
venv litellm "import litellm.proxy.proxy_server" "litellm[proxy]>=1.60,<2"
venv aiperf "import aiperf.cli" "aiperf>=0.2"
