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

installed() { # PACKAGE: true when dpkg has it installed
  [[ $(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null) == installed ]]
}
installed python3-pip || die "python3-pip is not installed on the host: run deploy/install-deps.sh"

# The installed dependency closure of python3-pip (Depends and Pre-Depends, the first
# installed alternative of each), kept to the Python packages themselves: the C
# libraries come from ldd below, and tools such as dpkg or openssl are not needed.
declare -A seen=()
queue=(python3-pip)
packages=()
while ((${#queue[@]})); do
  pkg=${queue[0]}
  queue=("${queue[@]:1}")
  [[ -n ${seen[$pkg]:-} ]] && continue
  seen[$pkg]=1
  [[ $pkg =~ ^(lib)?python3 ]] || continue
  packages+=("$pkg")
  deps=$(dpkg-query -W -f='${Pre-Depends}, ${Depends}' "$pkg")
  IFS=',' read -ra alternatives <<<"$deps"
  for alt in "${alternatives[@]}"; do
    IFS='|' read -ra choices <<<"$alt"
    for choice in "${choices[@]}"; do
      name=$(sed -e 's/([^)]*)//g' -e 's/:.*//' -e 's/[[:space:]]//g' <<<"$choice")
      [[ -n $name ]] || continue
      if installed "$name"; then
        queue+=("$name")
        break
      fi
    done
  done
done
mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort)
versions=$(dpkg-query -W -f='${Package}=${Version}\n' "${packages[@]}")

base_id=$(podman image inspect --format '{{.Id}}' "$base")
sba_sha=$(image_label "$base" io.cynode.sba.sha256)
recipe_sha=$(printf '%s\n%s\n' "$base_id" "$versions" | cat "$0" - | sha256sum | cut -d' ' -f1)

lock_name=$(printf '%s' "$image" | tr -c 'A-Za-z0-9._-' '_')
mkdir -p /run/lock
exec 9>"/run/lock/cynode-image-$lock_name.lock"
flock -w 900 9 || die "timed out waiting for the build lock of $image"

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
grep -E '\.so(\.|$)' "$work/files" | { cat; printf '%s\n' "$python"; } |
  xargs -r ldd 2>/dev/null | grep -o '/[^ ]* (0x' | sed 's/ (0x$//' | sort -u |
  while read -r lib; do
    printf '%s\n' "$lib"
    # Through the merged-/usr links the base image has (/lib -> usr/lib): a library
    # named under /lib is stored under /usr/lib, where the link leads.
    real=$(readlink -f "$lib")
    [[ $real != "$lib" ]] && printf '%s\n' "$real"
  done >>"$work/files"
[[ -f /etc/ssl/certs/ca-certificates.crt ]] && echo /etc/ssl/certs/ca-certificates.crt >>"$work/files"
# Under /usr only (paths under /lib, /bin go to /usr: the base image links them there).
mkdir -p "$work/ctx/root"
sort -u "$work/files" | while read -r f; do
  case $f in
    /lib/* | /lib64/* | /bin/* | /sbin/*) dest=/usr$f ;;
    *) dest=$f ;;
  esac
  mkdir -p "$work/ctx/root$(dirname "$dest")"
  cp -a "$f" "$work/ctx/root$dest"
done
tar --numeric-owner -C "$work/ctx/root" -cf "$work/ctx/python.tar" .
rm -rf "$work/ctx/root"
log "layer: $(du -m "$work/ctx/python.tar" | cut -f1) MiB"

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
