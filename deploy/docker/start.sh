#!/usr/bin/env bash
# deploy/docker/start.sh [IMAGE…] - a Docker daemon for the tests, with IMAGE… loaded.
#
# 1. When no dockerd answers on /var/run/docker.sock, starts one (no systemd here:
#    `dockerd` itself, in its own session, detached from this script's output), logging
#    to /var/cache/cynode/dockerd/dockerd.log, and writes its pid to
#    started.pid there, so whoever prepared the run (.ci/run) can stop it at the end when
#    this run started it. It waits (at most 60 s) for `docker info` to answer. The daemon
#    gets no default bridge and leaves iptables alone (`--bridge=none --iptables=false`,
#    unless /etc/docker/daemon.json sets those keys): CyNode's containers have no network.
#    deploy/install-deps.sh installs docker.io and registers the runsc runtime first.
# 2. Loads each IMAGE from podman's store into docker (`podman save | docker load`), the
#    same build as podman's, so nothing is pulled; only when docker lacks it or holds a
#    different image id under that name.
# Idempotent and quick when the daemon runs and the images are current.
set -euo pipefail
dir=/var/cache/cynode/dockerd
config=/etc/docker/daemon.json
log() { printf 'docker: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}
command -v dockerd >/dev/null 2>&1 || die "dockerd is missing: run deploy/install-deps.sh"

mkdir -p "$dir"
exec 9>"$dir/.lock"
flock -w 300 9 || die "timed out waiting for $dir/.lock"

answers() { timeout 20 docker info >/dev/null 2>&1; }

if ! answers; then
  flags=()
  for key in bridge iptables; do
    if ! jq -e --arg k "$key" 'has($k)' "$config" >/dev/null 2>&1; then
      case $key in
        bridge) flags+=(--bridge=none) ;;
        iptables) flags+=(--iptables=false) ;;
      esac
    fi
  done
  log "starting dockerd ${flags[*]} (log: $dir/dockerd.log)"
  setsid dockerd "${flags[@]}" </dev/null >>"$dir/dockerd.log" 2>&1 9>&- &
  pid=$!
  echo "$pid" >"$dir/started.pid"
  for _ in $(seq 1 120); do
    answers && break
    kill -0 "$pid" 2>/dev/null || die "dockerd exited; last log lines: $(tail -n 5 "$dir/dockerd.log")"
    sleep 0.5
  done
  answers || die "dockerd (pid $pid) did not answer within 60 s; see $dir/dockerd.log"
  log "dockerd (pid $pid) answers"
fi

for image in "$@"; do
  want=$(podman image inspect --format '{{.Id}}' "$image") || die "podman has no image $image"
  have=$(docker image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
  if [[ ${have#sha256:} == "${want#sha256:}" ]]; then
    continue
  fi
  log "loading $image (${want:0:12}) into docker"
  podman save "$image" | docker load >/dev/null
  # The image this one replaced under the name, unless a container still uses it.
  [[ -z $have ]] || docker rmi "$have" >/dev/null 2>&1 || true
  have=$(docker image inspect --format '{{.Id}}' "$image")
  [[ ${have#sha256:} == "${want#sha256:}" ]] ||
    die "docker holds $image as ${have:0:19}, podman as ${want:0:12}"
done
