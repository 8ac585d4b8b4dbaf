#!/usr/bin/env bash
# Installs Debian's Chromium (and its ChromeDriver) for the browser tests of the live view. The tests drive
# it with Playwright (the `test` extra), pointed at /usr/bin/chromium: Playwright's own browser download
# needs a network this machine does not have. Idempotent: an installed browser is kept.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null
