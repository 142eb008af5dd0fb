#!/usr/bin/env bash
# A Debian bookworm base image for the Dockerfile's BASE_IMAGE, from Debian's packages alone (no
# image registry): mmdebstrap bootstraps it, `docker import` makes it the local image TAG
# (default lmserve-base:bookworm). An image already tagged so is reused.
#
#   container/image/base.sh [TAG]
#
# Python 3.11 (the lock's), venv and headers, g++ for the C++ kernels, CA certificates; no docs,
# man pages or translations. Packages come from this machine's apt sources when it runs
# bookworm itself, else from mmdebstrap's default mirror.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source-path=SCRIPTDIR
source "$here/docker.sh"
pick_docker
tag=${1:-lmserve-base:bookworm}

if "$DOCKER" image inspect "$tag" >/dev/null 2>&1; then
    echo "base: reusing $tag"
    exit 0
fi

mirrors=()
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
if [[ $codename == bookworm ]]; then
    for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        if [[ -f $file ]]; then
            mirrors+=("$file")
        fi
    done
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A file first, imported only once whole: a failed bootstrap never leaves a tagged base behind.
mmdebstrap --variant=minbase \
    --include=python3,python3-venv,python3-dev,g++,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm "$work/base.tar" "${mirrors[@]}"
"$DOCKER" import --change 'CMD ["/bin/bash"]' "$work/base.tar" "$tag"
echo "base: built $tag"
