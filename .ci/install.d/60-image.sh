#!/usr/bin/env bash
# Builds llmtap's image with podman (.ci/image.sh: a Debian base made with mmdebstrap, then the Containerfile),
# tagged localhost/llmtap:<version>; tests/deploy/test_image.py runs it. The first build takes about 2 minutes (the base
# about 1), an unchanged rebuild a few seconds.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
started=$SECONDS
bash "$repo/.ci/image.sh"
echo "image built in $((SECONDS - started)) s"
