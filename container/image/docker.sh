# shellcheck shell=bash
# Sourced by the image scripts. pick_docker sets DOCKER to the first docker client on PATH that
# builds with BuildKit (--secret, RUN --mount): one with the buildx plugin, or Debian's docker.io
# (BuildKit built in). A CLI without buildx fails such builds ("buildx component is missing").

pick_docker() {
    if [[ -n ${DOCKER:-} ]]; then
        return 0
    fi
    local client help
    while read -r client; do
        help=$(DOCKER_BUILDKIT=1 "$client" build --help 2>/dev/null || true)
        if [[ $help == *--secret* ]]; then
            export DOCKER=$client
            return 0
        fi
    done < <(type -ap docker)
    echo "no docker client that builds with BuildKit (docker with buildx, or docker.io)" >&2
    return 1
}
