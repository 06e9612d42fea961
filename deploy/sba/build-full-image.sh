#!/usr/bin/env bash
# deploy/sba/build-full-image.sh - build the spec-compliant cynode-sba runner image offline.
#
# Usage:  deploy/sba/build-full-image.sh SBA_BINARY [IMAGE_NAME]
#   SBA_BINARY  the cynode-sba binary to put at /usr/local/bin/cynode-sba (statically
#               linked, or dynamically linked against this Debian 12's glibc: the image
#               is Debian 12 too)
#   IMAGE_NAME  default localhost/cynode-sba:latest
#
# This is the offline equivalent of deploy/sba/Containerfile (which needs a registry).
# The root filesystem is `debootstrap --variant=minbase bookworm` plus bash coreutils
# findutils diffutils procps tar gzip unzip zip jq ca-certificates git python3, with the
# non-root user `sandbox` (uid/gid 1000, HOME /home/sandbox), /workspace and /job owned
# by 1000 and /tmp mode 1777. That root filesystem is cached under
# /var/cache/cynode/rootfs-bookworm (Debian packages come from Debian's mirror the first
# time only); `podman import` then adds the binary and ENTRYPOINT
# ["/usr/local/bin/cynode-sba"], USER 1000:1000, WORKDIR /workspace and the labels
# io.cynodeai.sandbox.agent-compatible=true and io.cynodeai.sandbox.purpose. A last
# `podman run` with the sandbox flags checks every required tool is there.
#
# Idempotent: the image carries the binary's sha256 (label io.cynode.sba.sha256) and a
# hash of this recipe (label io.cynode.image.recipe); when an image of that name exists
# with both matching, nothing is rebuilt. Concurrent runs serialise on a lock file.
#
# Output: the image id on stdout (only that); progress on stderr.
# Environment:
#   CYNODE_IMAGE_FORCE=1       rebuild the image even when it is up to date
#   CYNODE_ROOTFS_REFRESH=1    rebuild the cached root filesystem too (runs debootstrap)
#   CYNODE_ROOTFS_CACHE=DIR    cache directory (default /var/cache/cynode/rootfs-bookworm)
#   CYNODE_DEBIAN_MIRROR=URL   default http://deb.debian.org/debian
# Needs: root, podman, debootstrap (deploy/install-deps.sh installs both).
set -euo pipefail

# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

[[ ${1:-} == -h || ${1:-} == --help ]] && usage 0
(($# >= 1 && $# <= 2)) || usage 2
sba_binary=$1
image=${2:-localhost/cynode-sba:latest}

SUITE=bookworm
PACKAGES=(bash coreutils findutils diffutils procps tar gzip unzip zip jq ca-certificates git
  python3)
# Purpose tokens from upstream sandbox_container.md; claim only what PACKAGES provides
# (python3 is there, pip/venv/gcc/make are not; no node, no go, no scanners).
PURPOSE="base-tools,python-tools"
# Bump when the cached root filesystem's recipe (below, in build_rootfs) changes.
ROOTFS_RECIPE_VERSION=1
cache=${CYNODE_ROOTFS_CACHE:-/var/cache/cynode/rootfs-$SUITE}
mirror=${CYNODE_DEBIAN_MIRROR:-http://deb.debian.org/debian}

[[ $(id -u) -eq 0 ]] || die "must run as root (debootstrap, root's podman store)"
command -v podman >/dev/null || die "podman not found: run deploy/install-deps.sh"
[[ -f $sba_binary && -x $sba_binary ]] || die "SBA_BINARY '$sba_binary' is not an executable file"


sba_sha=$(sha256sum "$sba_binary" | cut -d' ' -f1)
recipe_sha=$(sha256sum "$0" | cut -d' ' -f1)
stamp="suite=$SUITE recipe=$ROOTFS_RECIPE_VERSION packages=${PACKAGES[*]}"

mkdir -p /run/lock "$(dirname "$cache")"
exec 9>/run/lock/cynode-full-image.lock
flock -w 3600 9 || die "timed out waiting for /run/lock/cynode-full-image.lock"

force=0
[[ ${CYNODE_IMAGE_FORCE:-0} == 1 || ${CYNODE_ROOTFS_REFRESH:-0} == 1 ]] && force=1
exit_if_image_current "$image" "$sba_sha" "$recipe_sha" "$force"

# --- the cached root filesystem -----------------------------------------------------------
build_rootfs() {
  local dir=$1 include
  include=$(
    IFS=,
    echo "${PACKAGES[*]}"
  )
  command -v debootstrap >/dev/null || die "debootstrap not found: run deploy/install-deps.sh"
  log "debootstrap --variant=minbase --include=$include $SUITE from $mirror (takes minutes)"
  if ! debootstrap --variant=minbase --include="$include" "$SUITE" "$dir" "$mirror" >&2; then
    [[ -f $dir/debootstrap/debootstrap.log ]] && tail -n 20 "$dir/debootstrap/debootstrap.log" >&2
    die "debootstrap failed (is $mirror reachable?)"
  fi

  chroot "$dir" groupadd --gid 1000 sandbox
  chroot "$dir" useradd --uid 1000 --gid 1000 --create-home --home-dir /home/sandbox \
    --shell /bin/bash --comment "CyNode sandbox" sandbox
  mkdir -p "$dir/workspace" "$dir/job" "$dir/usr/local/bin"
  chown 1000:1000 "$dir/workspace" "$dir/job" "$dir/home/sandbox"
  chmod 0755 "$dir/workspace" "$dir/job" "$dir/home/sandbox"
  chmod 1777 "$dir/tmp" "$dir/var/tmp"

  # Nothing the sandbox needs: package caches, lists, logs, docs.
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/cache/apt/*.bin \
    "$dir"/var/lib/apt/lists/* "$dir"/var/log/* "$dir"/usr/share/doc/* \
    "$dir"/usr/share/man/* "$dir"/usr/share/info/* "$dir"/debootstrap
  # podman bind-mounts these at run time; start them empty rather than with the host's.
  : >"$dir/etc/resolv.conf"
  : >"$dir/etc/hostname"
}

if [[ ${CYNODE_ROOTFS_REFRESH:-0} == 1 || ! -f $cache/.cynode-stamp ||
  $(cat "$cache/.cynode-stamp" 2>/dev/null) != "$stamp" ]]; then
  tmp_cache="$cache.tmp.$$"
  rm -rf "$tmp_cache" "$cache".tmp.*
  trap 'rm -rf "$tmp_cache"' EXIT
  build_rootfs "$tmp_cache"
  printf '%s\n' "$stamp" >"$tmp_cache/.cynode-stamp"
  rm -rf "$cache"
  mv "$tmp_cache" "$cache"
  trap - EXIT
  log "cached root filesystem in $cache ($(du -sh "$cache" | cut -f1), $(elapsed))"
else
  log "using cached root filesystem $cache"
fi

# --- the image ----------------------------------------------------------------------------
extra=$(mktemp -d /var/tmp/cynode-full-image.XXXXXX)
trap 'rm -rf "$extra"' EXIT
install -D -m 0755 "$sba_binary" "$extra/usr/local/bin/cynode-sba"
chown 0:0 "$extra/usr/local/bin/cynode-sba"
[[ ! -e $cache/usr/local/bin/cynode-sba ]] || die "$cache must not contain cynode-sba"

log "importing $image"
# One tar stream: the cached tree, then the binary (its parent directories come from the
# cache, so no entry appears twice).
tar --numeric-owner -cf - -C "$cache" --exclude=./.cynode-stamp . \
  -C "$extra" ./usr/local/bin/cynode-sba |
  podman import --quiet \
    --change 'ENTRYPOINT ["/usr/local/bin/cynode-sba"]' \
    --change 'USER 1000:1000' \
    --change 'WORKDIR /workspace' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV HOME=/home/sandbox' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'LABEL io.cynodeai.sandbox.agent-compatible=true' \
    --change "LABEL io.cynodeai.sandbox.purpose=$PURPOSE" \
    --change "LABEL io.cynode.image.tools=$(
      IFS=,
      echo "${PACKAGES[*]}"
    )" \
    --change "LABEL io.cynode.sba.sha256=$sba_sha" \
    --change "LABEL io.cynode.image.recipe=$recipe_sha" \
    --change "LABEL io.cynode.image.base=debian-$SUITE-minbase" \
    --change 'LABEL org.opencontainers.image.title=cynode-sba' \
    --change 'LABEL org.opencontainers.image.description=CyNode sandbox agent runner (Debian 12 minbase)' \
    --message "cynode-sba runner image (sba sha256 $sba_sha)" \
    - "$image" >/dev/null

log "checking the image with the sandbox flags"
podman run --rm --runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1000:1000 \
  --network none --read-only --user 1000:1000 --cap-drop ALL \
  --security-opt no-new-privileges --memory 256m --pids-limit 64 \
  --entrypoint /bin/sh "$image" -c '
    set -e
    for t in bash sh cat cp mv rm mkdir chmod chown date find diff ps env tar gzip unzip \
        zip jq git python3 /usr/local/bin/cynode-sba; do
      command -v "$t" >/dev/null || { echo "missing: $t" >&2; exit 1; }
    done
    test -d /etc/ssl/certs && test "$(id -u):$(id -g)" = 1000:1000
    test "$(pwd)" = /workspace' >&2 ||
  die "image $image lacks a required tool or setting (see above)"

finish_image "$image"
