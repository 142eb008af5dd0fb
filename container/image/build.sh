#!/usr/bin/env bash
# Builds the image IMAGE (default lmserve) from the repository's Dockerfile, with BuildKit, on
# BASE_IMAGE when set (else the Dockerfile's default). Extra arguments go to `docker build`
# (e.g. --no-cache).
#
# pip inside the build uses this machine's pip configuration, read now (pip_passthrough.py): two
# build secrets, mounted only during the RUN steps that install, never in a layer or the history;
# local indexes and wheel folders are served on 127.0.0.1 while the build runs, which shares the
# host's network. PYTHON: the interpreter whose pip is asked (default python3).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source-path=SCRIPTDIR
source "$here/docker.sh"
pick_docker

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(--network host --progress plain -t "${IMAGE:-lmserve}"
    --secret "id=pip.conf,src=$work/pip.conf" --secret "id=pip-cert.pem,src=$work/pip-cert.pem")
if [[ -n ${BASE_IMAGE:-} ]]; then
    args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
fi
DOCKER_BUILDKIT=1 "${PYTHON:-python3}" "$here/pip_passthrough.py" "$work" -- \
    "$DOCKER" build "${args[@]}" "$@" "$root"
