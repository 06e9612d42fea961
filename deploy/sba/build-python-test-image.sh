#!/usr/bin/env bash
# deploy/sba/build-python-test-image.sh - the offline test image with Python and pip.
#
# Usage:  deploy/sba/build-python-test-image.sh [BASE_IMAGE] [IMAGE_NAME]
#   BASE_IMAGE  default localhost/cynode-sba-test:latest (deploy/sba/build-test-image.sh)
#   IMAGE_NAME  default localhost/cynode-sba-test-python:latest
#
# Nothing is pulled and nothing is downloaded: the image is BASE_IMAGE (busybox, the
# runner, user 1000, its entrypoint and labels) plus one layer holding the host's own
# Debian Python and pip. That layer is every file `dpkg -L` lists for the installed
# packages python3-pip depends on whose names start with python3 or libpython3
# (interpreter, standard library, pip, setuptools, wheel), the shared libraries that
# `ldd` finds for the interpreter and its extension modules (paths kept, as
# build-test-image.sh does for a dynamic runner), and the host's CA bundle. A last
# `podman run` with no network checks `python3 -m pip --version` in the image. About
# 40 MB; a build takes a few seconds.
#
# Idempotent: the image carries the base image's runner label (io.cynode.sba.sha256) and
# a hash of this recipe, the base image's id and the packages' versions
# (io.cynode.image.recipe); when an image of that name exists with both matching, nothing
# is rebuilt. Concurrent runs for one image name serialise on a lock file. A replaced
# image is removed unless a container still uses it.
#
# Output: the image id on stdout (only that); progress on stderr.
# Environment:
#   CYNODE_IMAGE_FORCE=1  rebuild even when the image is up to date
# Needs: root, podman, the base image, python3-pip installed on the host
# (deploy/install-deps.sh installs it).
set -euo pipefail

# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

[[ ${1:-} == -h || ${1:-} == --help ]] && usage 0
(($# <= 2)) || usage 2
base=${1:-localhost/cynode-sba-test:latest}
image=${2:-localhost/cynode-sba-test-python:latest}

[[ $(id -u) -eq 0 ]] || die "must run as root (root's podman store)"
command -v podman >/dev/null || die "podman not found: run deploy/install-deps.sh"
podman image exists "$base" || die "base image $base not found: run deploy/sba/build-test-image.sh"

installed python3-pip || die "python3-pip is not installed on the host: run deploy/install-deps.sh"

# The installed dependency closure of python3-pip, kept to the Python packages
# themselves: the C libraries come from ldd below, and tools such as dpkg or openssl are
# not needed.
dependency_closure '^(lib)?python3' '' python3-pip
versions=$(dpkg-query -W -f='${Package}=${Version}\n' "${packages[@]}")

base_id=$(podman image inspect --format '{{.Id}}' "$base")
sba_sha=$(image_label "$base" io.cynode.sba.sha256)
recipe_sha=$(printf '%s\n%s\n' "$base_id" "$versions" | cat "$0" "$cynode_lib" - | sha256sum | cut -d' ' -f1)

lock_image "$image"

exit_if_image_current "$image" "$sba_sha" "$recipe_sha" "${CYNODE_IMAGE_FORCE:-0}"

work=$(mktemp -d /var/tmp/cynode-python-image.XXXXXX)
trap 'rm -rf "$work"' EXIT
log "building $image from $base with ${packages[*]}"

# The packages' files (directories are made by tar as needed).
dpkg -L "${packages[@]}" | sort -u | while read -r f; do
  [[ -f $f || -L $f ]] && printf '%s\n' "$f"
done >"$work/files"
# The interpreter's and the extension modules' shared libraries, and the CA bundle.
python=$(readlink -f /usr/bin/python3)
grep -E '\.so(\.|$)' "$work/files" | { cat; printf '%s\n' "$python"; } | add_libraries >>"$work/files"
mkdir -p "$work/ctx"
pack_layer "$work/files" "$work/ctx/python.tar"

cat >"$work/ctx/Containerfile" <<EOF
FROM $base
ADD python.tar /
LABEL io.cynode.image.recipe=$recipe_sha
LABEL org.opencontainers.image.title=cynode-sba-test-python
LABEL org.opencontainers.image.description="busybox-based CyNode SBA test image with the host's Debian python3 and pip"
EOF
podman build --pull=never --quiet --network none -t "$image" "$work/ctx" >/dev/null

out=$(podman run --rm --pull=never --network none --entrypoint /usr/bin/python3 "$image" \
  -m pip --version 2>&1) || die "python3 -m pip fails in $image: $out"
log "$out"
finish_image "$image"
