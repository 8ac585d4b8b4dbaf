#!/usr/bin/env bash
# Builds llmtap's image (the repository's Containerfile) with podman, on a machine with no container registry:
# a Debian bookworm root filesystem made here with mmdebstrap stands in for the official Python slim base.
#
#   bash .ci/image.sh              build localhost/llmtap:<version> and :latest (the version is pyproject.toml's)
#   bash .ci/image.sh --print-tag  print the version's tag and exit (--print-version: the version alone)
#   bash .ci/image.sh --print-conf print the containers.conf the build and the tests run podman with, and exit
#   bash .ci/image.sh --sizes      after building: what each layer and each installed distribution weighs
#   LLMTAP_IMAGE_EXTRAS=analysis bash .ci/image.sh    the same with extras (tag <version>-analysis)
#
# Idempotent: installs podman, runc, mmdebstrap and uidmap through apt when missing; makes the base image
# (localhost/llmtap-base:bookworm) once; podman's layer cache makes an unchanged rebuild a few seconds.
# podman runs with a containers.conf of this run's own (CONTAINERS_CONF; /etc is left alone): runc, since crun
# refuses this host's cgroups, and rlimits within the host's. PyPI's TLS may be re-signed by a CA only the host
# trusts: the host's CA bundle goes to pip as a build secret, never into a layer. Run as root.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
tools="${LLMTAP_TOOLS:-$repo/.tools}"
conf="$tools/podman/containers.conf"
base="${LLMTAP_IMAGE_BASE:-localhost/llmtap-base:bookworm}"
mirror="${LLMTAP_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
started=$SECONDS

# The one version string: pyproject.toml's; the project's source address from its [project.urls] when it has one.
read -r version source < <(python3 - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
urls = project.get("urls", {})
print(project["version"], next((urls[k] for k in ("Source", "Repository", "Homepage") if k in urls), ""))
EOF
)
extras="${LLMTAP_IMAGE_EXTRAS:-}"
tag="localhost/llmtap:$version${extras:+-${extras//,/-}}"
latest="localhost/llmtap:latest${extras:+-${extras//,/-}}"

sizes=0
case "${1:-}" in
    --print-tag) echo "$tag"; exit 0 ;;
    --print-version) echo "$version"; exit 0 ;;
    --print-conf) echo "$conf"; exit 0 ;;
    --sizes) sizes=1 ;;
    "") ;;
    *) echo "usage: $0 [--print-tag | --print-version | --print-conf | --sizes]" >&2; exit 2 ;;
esac

step() { echo "== image: $* ($((SECONDS - started)) s)"; }

missing=()
for pair in podman:podman runc:runc mmdebstrap:mmdebstrap newuidmap:uidmap; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
if [ "${#missing[@]}" -gt 0 ]; then
    step "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p "$(dirname "$conf")"
cat > "$conf" <<'EOF'
# Written by .ci/image.sh: podman as this project's CI runs it (CONTAINERS_CONF points here).
[containers]
# podman's default rlimits exceed what this host allows a process.
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
# crun refuses this host's cgroups; runc runs.
runtime = "runc"
EOF
export CONTAINERS_CONF="$conf"

# The base's recipe: the image is made again when it changes (its digest is a label of the base).
recipe=(--variant=minbase --include=python3,python3-venv,ca-certificates
    # merged /usr as Debian's own images have it, without usrmerge (which brings 47 MB of perl)
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
    # no documentation, man pages or locales, and no apt lists: as the official slim images
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*'
    --dpkgopt='path-exclude=/usr/share/info/*'
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*.log'
    bookworm
)
sources=("deb $mirror bookworm main" "deb $mirror bookworm-updates main"
    "deb ${mirror%/debian}/debian-security bookworm-security main")
digest="$(printf '%s\n' "${recipe[@]}" "${sources[@]}" | sha256sum | cut -c1-16)"
if [ "$(podman image inspect --format '{{index .Labels "llmtap.base.recipe"}}' "$base" 2>/dev/null)" = "$digest" ]; then
    step "base $base present"
else
    step "making base $base with mmdebstrap"
    rootfs="$(mktemp -d)"
    trap 'rm -rf "$rootfs"' EXIT
    # minbase and Python with its venv module: what the official python:slim image holds, from Debian's archive.
    mmdebstrap --quiet "${recipe[@]}" "$rootfs/base.tar" "${sources[@]}" </dev/null >"$rootfs/log" 2>&1 ||
        { tail -n 40 "$rootfs/log" >&2; exit 1; }
    podman import --quiet --change 'CMD ["/bin/bash"]' --change "LABEL llmtap.base.recipe=$digest" \
        "$rootfs/base.tar" "$base" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
fi

step "building $tag on $base"
secret=()
ca="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
[ -s "$ca" ] && secret=(--secret "id=ca,src=$ca")
podman build --quiet --network host --file Containerfile \
    --build-arg "BASE=$base" --build-arg "VERSION=$version" --build-arg "SOURCE=$source" \
    --build-arg "EXTRAS=$extras" "${secret[@]}" --tag "$tag" --tag "$latest" . >/dev/null

step "built $tag: $(podman image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}')"
if [ "$sizes" = 1 ]; then
    echo "-- layers (podman history):"
    podman history --format '{{.Size}}	{{.CreatedBy}}' "$tag" | grep -v '^0 B' | cut -c1-100
    echo "-- installed distributions:"
    podman run --rm -i --network none --entrypoint python "$tag" - --sizes < .ci/image-slim.py
fi
echo "run it: podman run --rm --read-only --tmpfs /tmp -e LLMTAP_UPSTREAM=https://api.openai.com -p 127.0.0.1:8080:8080 $tag"
echo "$tag"
