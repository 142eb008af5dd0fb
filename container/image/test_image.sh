#!/usr/bin/env bash
# `make image-test`: builds the image on a Debian base of its own and checks it running
# (test_image.py's scenarios); the last line is `N passed, N failed`.
#
# Provides what that needs: Debian's docker.io and mmdebstrap (apt-get, when missing) and a
# Docker daemon (dockerd started in the background when none answers, and stopped at the end).
# PYTHON: an interpreter with lmserve's test dependencies (make passes .venv's).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source-path=SCRIPTDIR
source "$here/docker.sh"

missing=()
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v dockerd >/dev/null || missing+=(docker.io)
if ((${#missing[@]})); then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi
pick_docker

dockerd_pid=
log=
stop_dockerd() {
    if [[ -n $dockerd_pid ]]; then
        kill "$dockerd_pid" 2>/dev/null || true
        wait "$dockerd_pid" || true
    fi
    rm -f "$log"
}
if ! "$DOCKER" info >/dev/null 2>&1; then
    log=$(mktemp -t dockerd-XXXXXX.log)
    dockerd >"$log" 2>&1 &
    dockerd_pid=$!
    trap stop_dockerd EXIT
    # A hang guard: the daemon is used as soon as it answers.
    for _ in $(seq 600); do
        if "$DOCKER" info >/dev/null 2>&1; then
            break
        fi
        if ! kill -0 "$dockerd_pid" 2>/dev/null; then
            echo "dockerd exited:" >&2
            tail -20 "$log" >&2
            exit 1
        fi
        sleep 0.2
    done
    "$DOCKER" info >/dev/null
fi

"${PYTHON:-python3}" -P "$here/test_image.py"
