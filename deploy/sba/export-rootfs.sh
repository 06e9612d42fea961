#!/usr/bin/env bash
# export-rootfs.sh IMAGE: unpacks a local podman image into a root filesystem directory
# for the bwrap backend, cached by image id under ${CYNODE_ROOTFS_DIR:-/var/cache/cynode/rootfs}.
# Beside the directory, <dir>.labels.json holds the image's labels (a JSON object, from
# podman's metadata): the worker reads io.cynodeai.sandbox.agent-compatible there, never
# from a file inside the root filesystem, which is the image's own content.
# Prints the directory on stdout.
set -euo pipefail
image=${1:?usage: export-rootfs.sh IMAGE}
base=${CYNODE_ROOTFS_DIR:-/var/cache/cynode/rootfs}
id=$(podman image inspect --format '{{.Id}}' "$image")
dir="$base/${id:0:16}"
write_labels() {
  [[ -f $dir.labels.json ]] && return 0
  podman image inspect --format '{{json .Config.Labels}}' "$image" >"$dir.labels.json.tmp"
  mv -f "$dir.labels.json.tmp" "$dir.labels.json"
}
if [[ -f $dir/.complete && -f $dir.labels.json ]]; then
  echo "$dir"
  exit 0
fi
mkdir -p "$base"
exec 9>"$base/.lock"
flock -w 600 9
write_labels
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
