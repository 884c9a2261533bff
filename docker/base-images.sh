#!/usr/bin/env bash
# Local stand-ins for the two public base images, for hosts that reach no image registry
# (the project's test machines): Debian bookworm root file systems made with debootstrap
# from Debian's packages and loaded with `docker import`.
#   qrl-base:bookworm    for python:3.11-slim  (Debian's python3 3.11, venv, pip)
#   qrl-redis:bookworm   for redis:7           (Debian's redis-server 7.0)
#   qrl-prometheus:bookworm for prom/prometheus (Debian's prometheus 2.42: the metrics profile)
# Use them through the compose variables, e.g. in .env:
#   QRL_BASE_IMAGE=qrl-base:bookworm
#   QRL_REDIS_IMAGE=qrl-redis:bookworm
#   QRL_PROMETHEUS_IMAGE=qrl-prometheus:bookworm
# This host's CA bundle goes into both (and PIP_CERT names it), so that pip in a build
# trusts what this host trusts. Needs root, debootstrap and a Debian mirror.
# Usage: docker/base-images.sh [MIRROR]   (an image that exists already is kept)
set -euo pipefail
MIRROR=${1:-http://deb.debian.org/debian}
CA=/etc/ssl/certs/ca-certificates.crt

make_image() { # TAG PACKAGES DOCKER-IMPORT-CHANGES...
    local tag=$1 packages=$2
    shift 2
    if docker image inspect "$tag" >/dev/null 2>&1; then
        echo "$tag: exists"
        return
    fi
    local root
    root=$(mktemp -d)
    trap 'rm -rf "$root"' RETURN
    debootstrap --variant=minbase --include="$packages" bookworm "$root" "$MIRROR" >&2
    cp "$CA" "$root/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    local changes=()
    for c in "$@"; do changes+=(--change "$c"); done
    tar -C "$root" -c . | docker import "${changes[@]}" - "$tag"
    echo "$tag: imported"
}

make_image qrl-base:bookworm python3,python3-venv,python3-pip,ca-certificates \
    'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    'ENV LANG=C.UTF-8' \
    'CMD ["python3"]'
make_image qrl-redis:bookworm redis-server,ca-certificates \
    'WORKDIR /data' \
    'CMD ["redis-server"]'
make_image qrl-prometheus:bookworm prometheus,ca-certificates \
    'WORKDIR /prometheus' \
    'ENTRYPOINT ["/usr/bin/prometheus"]'
