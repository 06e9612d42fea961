#!/usr/bin/env bash
# export-rootfs.sh IMAGE: unpacks a local podman image into a root filesystem directory
# for the bwrap backend, cached by image id under ${CYNODE_ROOTFS_DIR:-/var/cache/cynode/rootfs}.
# Prints the directory on stdout.
set -euo pipefail
image=${1:?usage: export-rootfs.sh IMAGE}
base=${CYNODE_ROOTFS_DIR:-/var/cache/cynode/rootfs}
id=$(podman image inspect --format '{{.Id}}' "$image")
dir="$base/${id:0:16}"
if [[ -f $dir/.complete ]]; then
  echo "$dir"
  exit 0
fi
mkdir -p "$base"
exec 9>"$base/.lock"
flock -w 600 9
if [[ ! -f $dir/.complete ]]; then
  tmp=$(mktemp -d "$base/.tmp.XXXXXX")
  ctr=$(podman create --pull=never "$image" true)
  trap 'podman rm -f "$ctr" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
  podman export "$ctr" | tar --numeric-owner -C "$tmp" -xf -
  chmod 0755 "$tmp"
  touch "$tmp/.complete"
  rm -rf "$dir"
  mv "$tmp" "$dir"
  echo "export-rootfs: $image -> $dir" >&2
fi
echo "$dir"
