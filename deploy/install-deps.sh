#!/usr/bin/env bash
# deploy/install-deps.sh - install and configure the host tools CyNode's test suite needs.
#
# Usage:  deploy/install-deps.sh          (no arguments; run as root on Debian 12)
#
# What it does, idempotently:
#   1. installs podman, runc, catatonit (the init `podman run --init` needs for session
#      sandboxes), bubblewrap, busybox-static, git (the worker's changesets), curl (the
#      model server scripts), patch, debootstrap, uidmap, slirp4netns, fuse-overlayfs,
#      hyperfine, docker.io (a real Docker engine; it brings containerd and tini, whose
#      docker-init session containers use), runsc (gVisor), jq (step 3's merge) and
#      e2fsprogs (mke2fs, for the kernel-enforced disk volumes), xfsprogs (an XFS with
#      reflink, where the snapshot test sees copy-on-write forks), python3-pip, and the
#      toolchains of the dependency-fetch tests (deploy/sba/build-toolchain-test-image.sh):
#      nodejs with npm, golang-go (Go 1.19: 81 MB to download, 464 MB installed) and
#      cargo-web (cargo and rustc 1.96 from bookworm's security updates, with gcc and its
#      standard library: 100 MB, 459 MB; bookworm's `cargo` is 0.66, older than sparse
#      registries and Cargo.lock v4) with apt
#      (skipped in well under a second when dpkg-query says they are all installed
#      already);
#   2. configures podman for this kind of machine with the drop-in
#      /etc/containers/containers.conf.d/50-cynode.conf (rewritten only when it changes):
#        - runtime = "runc": crun refuses this kernel's hybrid cgroup v1/v2 layout;
#        - default_ulimits lowered to nofile=1024:1024 and nproc=4096:4096: podman's own
#          defaults raise RLIMIT_NOFILE/RLIMIT_NPROC above the hard limits, which fails
#          ("error setting rlimit type 7: operation not permitted") because root here
#          lacks CAP_SYS_RESOURCE;
#        - without systemd as PID 1: cgroup_manager = "cgroupfs", events_logger = "file";
#   3. registers gVisor with Docker in /etc/docker/daemon.json, merged into whatever the
#      file holds and rewritten only when that changes: runtimes.runsc = /usr/bin/runsc
#      with `--network=none` (runsc refuses to start a container whose network is not its
#      own otherwise; CyNode's containers have no network anyway), `--oci-seccomp` (or
#      runsc ignores the seccomp profile a container is given) and `--host-uds=open` (a
#      job connects to the node's sockets under /job) - the flags the worker's
#      engine.rs RUNSC_FLAGS passes Podman - and, without systemd
#      as PID 1, the cgroupfs cgroup driver unless the file names one. A dockerd already
#      running is sent SIGHUP to reload it. Nothing here starts dockerd: deploy/test-env.sh
#      does, for the tests;
#   4. smoke-tests podman (a busybox root filesystem through `podman run --rootfs`, once
#      with the defaults above and once with the full sandbox flag set the worker uses)
#      and bubblewrap, and gVisor under podman (`--runtime /usr/bin/runsc --runtime-flag
#      network=none`), then prints the tool versions.
#
# Environment:
#   CYNODE_SKIP_SMOKE=1   skip step 4's smoke tests (versions are still printed)
#
# Package availability: every package below was checked with `apt-cache policy` on
# Debian 12 (bookworm) and has an install candidate there, so none is dropped. Should a
# package have no candidate on some other machine, the script drops it with a warning
# instead of failing the whole install. debootstrap's keyring (debian-archive-keyring)
# and signature checker (gpgv) are not listed: apt itself depends on both.
set -euo pipefail

PACKAGES=(podman runc catatonit bubblewrap busybox-static git curl patch debootstrap uidmap
  slirp4netns fuse-overlayfs hyperfine docker.io runsc jq e2fsprogs xfsprogs python3-pip
  nodejs golang-go cargo-web)
DROPIN_DIR=/etc/containers/containers.conf.d
DROPIN="$DROPIN_DIR/50-cynode.conf"
DOCKER_CONFIG_FILE=/etc/docker/daemon.json
LOCK_FILE=/run/lock/cynode-install-deps.lock

log() { printf 'install-deps: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    exec sudo -n -- "$0" "$@"
  fi
  die "must run as root (apt-get and /etc/containers need it)"
fi

# Several test binaries may call this script at once: run one copy at a time.
mkdir -p "$(dirname "$LOCK_FILE")"
exec 9>"$LOCK_FILE"
flock -w 1800 9 || die "timed out waiting for $LOCK_FILE"

start=$(date +%s.%N)

# npm: Debian's nodejs (18) needs the npm package; NodeSource's nodejs bundles npm and
# Provides and Conflicts with it. Asked for only when nothing provides it.
if ! command -v npm >/dev/null 2>&1; then
  node_candidate=$(apt-cache policy nodejs 2>/dev/null | awk '/Candidate:/ {print $2; exit}')
  if ! apt-cache show "nodejs=$node_candidate" 2>/dev/null | grep -Eq '^Provides:.*\bnpm\b'; then
    PACKAGES+=(npm)
  fi
fi

is_installed() {
  [[ $(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null) == "ii"* ]]
}

has_candidate() {
  local candidate
  candidate=$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2; exit}')
  [[ -n $candidate && $candidate != "(none)" ]]
}

# --- 1. packages ---------------------------------------------------------------------
missing=()
for pkg in "${PACKAGES[@]}"; do
  is_installed "$pkg" || missing+=("$pkg")
done

if ((${#missing[@]} == 0)); then
  log "all ${#PACKAGES[@]} packages already installed; skipping apt"
else
  log "missing packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Another apt may hold the lists lock for a while (e.g. unattended upgrades): retry.
  for attempt in 1 2 3 4 5 6; do
    if apt-get -o DPkg::Lock::Timeout=600 update -q; then
      break
    fi
    ((attempt == 6)) && die "apt-get update failed"
    log "apt-get update failed (attempt $attempt); retrying in 10 s"
    sleep 10
  done
  installable=()
  for pkg in "${missing[@]}"; do
    if has_candidate "$pkg"; then
      installable+=("$pkg")
    else
      log "warning: package '$pkg' has no install candidate here; skipping it"
    fi
  done
  if ((${#installable[@]} > 0)); then
    apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends \
      "${installable[@]}"
  fi
fi

# --- 2. podman configuration ---------------------------------------------------------
if [[ -d /run/systemd/system ]]; then
  systemd_settings=""
else
  # No systemd as PID 1 (containers, CI sandboxes): no systemd cgroup manager, no journald.
  systemd_settings=$'cgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
fi
dropin_content="# Written by CyNode deploy/install-deps.sh (rewritten whenever it differs).
# runc: crun refuses the hybrid cgroup layout of the kernels CyNode is tested on.
# default_ulimits: podman's defaults exceed the hard limits and root has no
# CAP_SYS_RESOURCE here, so every container would fail to start without these.
[containers]
default_ulimits = [\"nofile=1024:1024\", \"nproc=4096:4096\"]

[engine]
runtime = \"runc\"
${systemd_settings}"

mkdir -p "$DROPIN_DIR"
if [[ -f $DROPIN ]] && [[ $(cat "$DROPIN") == "$(printf '%s' "$dropin_content")" ]]; then
  log "podman drop-in $DROPIN is up to date"
else
  tmp=$(mktemp "$DROPIN.XXXXXX")
  printf '%s' "$dropin_content" >"$tmp"
  chmod 0644 "$tmp"
  mv -f "$tmp" "$DROPIN"
  log "wrote podman drop-in $DROPIN"
fi

runtime=$(podman info --format '{{.Host.OCIRuntime.Name}}')
[[ $runtime == runc ]] || die "podman uses OCI runtime '$runtime', expected runc"

# --- 3. docker configuration: gVisor registered ---------------------------------------
# The runsc entry is CyNode's; every other key of an existing file is kept as it is.
docker_filter='.runtimes.runsc = {"path": "/usr/bin/runsc",
  "runtimeArgs": ["--network=none", "--oci-seccomp", "--host-uds=open"]}'
if [[ ! -d /run/systemd/system ]]; then
  docker_filter+=' | if ((."exec-opts" // []) | any(startswith("native.cgroupdriver="))) then .
    else ."exec-opts" = ((."exec-opts" // []) + ["native.cgroupdriver=cgroupfs"]) end'
fi
mkdir -p "$(dirname "$DOCKER_CONFIG_FILE")"
docker_old=$(cat "$DOCKER_CONFIG_FILE" 2>/dev/null || echo '{}')
[[ -n ${docker_old//[[:space:]]/} ]] || docker_old='{}'
docker_new=$(jq "$docker_filter" <<<"$docker_old") ||
  die "$DOCKER_CONFIG_FILE is not valid JSON; fix it and run again"
if [[ $(jq -S . <<<"$docker_old") == "$(jq -S . <<<"$docker_new")" ]]; then
  log "docker config $DOCKER_CONFIG_FILE is up to date"
else
  tmp=$(mktemp "$DOCKER_CONFIG_FILE.XXXXXX")
  printf '%s\n' "$docker_new" >"$tmp"
  chmod 0644 "$tmp"
  mv -f "$tmp" "$DOCKER_CONFIG_FILE"
  log "wrote docker config $DOCKER_CONFIG_FILE (runsc runtime registered)"
  # A running daemon reloads its runtimes on SIGHUP.
  if dockerd_pid=$(pidof dockerd); then
    # shellcheck disable=SC2086 # one pid per word
    kill -HUP $dockerd_pid && log "dockerd (pid $dockerd_pid) reloaded"
  fi
fi

# --- 4. smoke tests --------------------------------------------------------------------
if [[ ${CYNODE_SKIP_SMOKE:-0} != 1 ]]; then
  smoke_dir=$(mktemp -d /tmp/cynode-smoke.XXXXXX)
  trap 'rm -rf "$smoke_dir"' EXIT
  mkdir -p "$smoke_dir/rootfs/bin" "$smoke_dir/rootfs/etc" "$smoke_dir/rootfs/tmp"
  cp /bin/busybox "$smoke_dir/rootfs/bin/busybox"
  for applet in sh id echo true; do
    ln -s busybox "$smoke_dir/rootfs/bin/$applet"
  done

  # Defaults only: proves the drop-in (runtime, ulimits) is in effect.
  out=$(podman run --rm --rootfs "$smoke_dir/rootfs" /bin/sh -c 'echo smoke-ok')
  [[ $out == smoke-ok ]] || die "podman smoke test (defaults) printed '$out'"

  # The flag set the worker's podman backend uses.
  out=$(podman run --rm --runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1000:1000 \
    --network none --read-only --user 1000:1000 --cap-drop ALL \
    --security-opt no-new-privileges --memory 256m --pids-limit 64 \
    --rootfs "$smoke_dir/rootfs" /bin/sh -c 'echo "smoke-ok $(id -u):$(id -g)"')
  [[ $out == "smoke-ok 1000:1000" ]] || die "podman smoke test (sandbox flags) printed '$out'"

  # Session sandboxes run under an init (catatonit) as PID 1.
  out=$(podman run --rm --init --rootfs "$smoke_dir/rootfs" /bin/sh -c 'echo init-ok')
  [[ $out == init-ok ]] || die "podman smoke test (--init) printed '$out'"

  # gVisor: runsc needs its own network flag, or it refuses the root network namespace.
  out=$(podman run --rm --runtime /usr/bin/runsc --runtime-flag network=none --network none \
    --rootfs "$smoke_dir/rootfs" /bin/sh -c 'echo runsc-ok')
  [[ $out == runsc-ok ]] || die "podman smoke test (runsc) printed '$out'"

  bwrap --ro-bind / / --dev /dev --proc /proc --unshare-all --die-with-parent true ||
    die "bubblewrap smoke test failed"
  log "smoke tests passed (podman defaults, podman sandbox flags, podman --init, podman runsc, bubblewrap)"
fi

# --- versions ------------------------------------------------------------------------
first_line() { "$@" 2>&1 | head -n 1 || true; }
echo "podman:         $(first_line podman --version)"
echo "runc:           $(first_line runc --version)"
echo "catatonit:      $(first_line /usr/libexec/podman/catatonit --version)"
echo "git:            $(first_line git --version)"
echo "bubblewrap:     $(first_line bwrap --version)"
echo "busybox:        $(first_line busybox)"
echo "patch:          $(first_line patch --version)"
echo "debootstrap:    $(first_line debootstrap --version)"
echo "newuidmap:      $(dpkg-query -W -f='${Version}' uidmap 2>/dev/null || echo missing)"
echo "slirp4netns:    $(first_line slirp4netns --version)"
echo "fuse-overlayfs: $(fuse-overlayfs --version 2>/dev/null | grep -m1 '^fuse-overlayfs' || true)"
echo "hyperfine:      $(first_line hyperfine --version)"
echo "docker:         $(first_line docker --version)"
echo "dockerd:        $(first_line dockerd --version)"
echo "runsc:          $(first_line runsc --version)"
echo "node:           $(first_line node --version)"
echo "npm:            $(first_line npm --version)"
echo "go:             $(first_line /usr/bin/go version)"
echo "cargo (Debian): $(first_line /usr/bin/cargo --version)"
log "done in $(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN {printf "%.2f s", e - s}')"
