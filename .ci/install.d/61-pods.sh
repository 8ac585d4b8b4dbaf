#!/usr/bin/env bash
# What `podman kube play` needs beyond the image build (tests/deploy/test_pods.py plays the chart as pods): catatonit,
# the init podman makes each pod's infra (pause) image from, and iproute2 for the pods' own network namespace.
# Idempotent: what is installed is kept.
set -euo pipefail
missing=()
command -v catatonit >/dev/null 2>&1 || [ -x /usr/libexec/podman/catatonit ] || missing+=(catatonit)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v nsenter >/dev/null 2>&1 || missing+=(util-linux)
[ "${#missing[@]}" -eq 0 ] && exit 0
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
