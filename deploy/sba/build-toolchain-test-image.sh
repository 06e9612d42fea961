#!/usr/bin/env bash
# deploy/sba/build-toolchain-test-image.sh - the offline test image with Node.js and npm,
# Go, and cargo with rustc: the tools node-test's `npm ci`, go-test's `go mod download`
# and rust-test's `cargo fetch` run.
#
# Usage:  deploy/sba/build-toolchain-test-image.sh [BASE_IMAGE] [IMAGE_NAME]
#   BASE_IMAGE  default localhost/cynode-sba-test:latest (deploy/sba/build-test-image.sh)
#   IMAGE_NAME  default localhost/cynode-sba-test-toolchains:latest
#
# Nothing is pulled and nothing is downloaded: the image is BASE_IMAGE (busybox, the
# runner, user 1000, its entrypoint and labels) plus one layer holding the host's own
# Debian packages, as build-python-test-image.sh does for Python. That layer is every
# file `dpkg -L` lists for the installed dependency closure of nodejs (and npm when it is
# a package of its own: Debian's nodejs needs it, NodeSource's nodejs bundles npm),
# golang-go and cargo-web, kept to the packages whose names start with nodejs, npm,
# node-, libnode, golang-, cargo-web, rustc-web or libstd-rust-web-<version> (the C
# libraries come from ldd), less what no fetch or test step reads: documentation, C
# headers, Go's own test suite, testdata directories and the sources and objects of the
# Go commands (src/cmd, pkg/linux_amd64/cmd). It adds the shared libraries `ldd` finds
# for the programs and libraries among those files (paths kept, under /usr as the base
# image's merged-/usr links want) and the host's CA bundle.
#
# What runs in it: node, npm (`npm ci`, `npm test`), go (`go mod download`, `go test`
# with CGO_ENABLED=0: the standard library's sources and objects are in), cargo and rustc
# (`cargo fetch`, which asks `rustc -vV`). Not cargo build or test: the Rust standard
# library (libstd-rust-web-dev, 170 MB), gcc and binutils are left out.
#
# Idempotent: the image carries the base image's runner label (io.cynode.sba.sha256) and
# a hash of this recipe, the base image's id and the packages' versions
# (io.cynode.image.recipe); when an image of that name exists with both matching, nothing
# is rebuilt. Concurrent runs for one image name serialise on a lock file. A replaced
# image is removed unless a container still uses it. A last `podman run` with no network
# checks that each tool starts in the image.
#
# Output: the image id on stdout (only that); progress on stderr.
# Environment:
#   CYNODE_IMAGE_FORCE=1  rebuild even when the image is up to date
# Needs: root, podman, the base image, nodejs (with npm), golang-go and cargo-web
# installed on the host (deploy/install-deps.sh installs them).
set -euo pipefail

# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

[[ ${1:-} == -h || ${1:-} == --help ]] && usage 0
(($# <= 2)) || usage 2
base=${1:-localhost/cynode-sba-test:latest}
image=${2:-localhost/cynode-sba-test-toolchains:latest}

[[ $(id -u) -eq 0 ]] || die "must run as root (root's podman store)"
command -v podman >/dev/null || die "podman not found: run deploy/install-deps.sh"
podman image exists "$base" || die "base image $base not found: run deploy/sba/build-test-image.sh"

roots=()
for pkg in nodejs golang-go cargo-web; do
  installed "$pkg" || die "$pkg is not installed on the host: run deploy/install-deps.sh"
  roots+=("$pkg")
done
installed npm && roots+=(npm)
[[ -x /usr/bin/npm ]] || die "no /usr/bin/npm on the host: run deploy/install-deps.sh"

# The installed dependency closure of the roots, kept to the toolchains' own packages;
# the Rust standard library's rlibs are followed (to librustc_driver's package), not kept.
dependency_closure '^(nodejs|npm|node-|libnode[0-9]|golang-|cargo-web|rustc-web|libstd-rust-web-)' \
  '^libstd-rust-web-dev$' "${roots[@]}"
versions=$(dpkg-query -W -f='${Package}=${Version}\n' "${packages[@]}")
# npm as it is on disk: `npm install -g npm` replaces NodeSource's bundled copy in place,
# outside dpkg's lists (this machine's is such a copy). Its version joins the recipe.
npm_dir=/usr/lib/node_modules/npm
npm_version=$(node "$npm_dir/bin/npm-cli.js" --version 2>/dev/null) || die "npm does not run on the host"
versions+=$'\n'"npm-on-disk=$npm_version"

base_id=$(podman image inspect --format '{{.Id}}' "$base")
sba_sha=$(image_label "$base" io.cynode.sba.sha256)
recipe_sha=$(printf '%s\n%s\n' "$base_id" "$versions" | cat "$0" "$cynode_lib" - | sha256sum | cut -d' ' -f1)

lock_image "$image"

exit_if_image_current "$image" "$sba_sha" "$recipe_sha" "${CYNODE_IMAGE_FORCE:-0}"

work=$(mktemp -d /var/tmp/cynode-toolchain-image.XXXXXX)
trap 'rm -rf "$work"' EXIT
log "building $image from $base with ${#packages[@]} packages: ${packages[*]}"

# The packages' files (directories are made by tar as needed), less what no step reads.
skip='^/usr/(share/(doc|man|lintian|bug|info)/|include/)|/testdata/'
skip+='|^/usr/share/go-[0-9.]+/(test|misc|api)/|^/usr/share/go-[0-9.]+/src/cmd/'
skip+='|^/usr/lib/go-[0-9.]+/pkg/linux_amd64/cmd/'
dpkg -L "${packages[@]}" | sort -u | grep -Ev "$skip" | while read -r f; do
  if [[ -f $f || -L $f ]]; then printf '%s\n' "$f"; fi
done >"$work/files"
find "$npm_dir" \( -type f -o -type l \) >>"$work/files"
# The shared libraries of the programs and libraries among them, and the CA bundle.
grep -E '/bin/[^/]+$|\.so(\.|$)' "$work/files" | while read -r f; do
  readlink -f "$f"
done | sort -u | add_libraries >>"$work/files"
mkdir -p "$work/ctx"
pack_layer "$work/files" "$work/ctx/toolchains.tar"

cat >"$work/ctx/Containerfile" <<EOF
FROM $base
ADD toolchains.tar /
LABEL io.cynode.image.recipe=$recipe_sha
LABEL org.opencontainers.image.title=cynode-sba-test-toolchains
LABEL org.opencontainers.image.description="busybox-based CyNode SBA test image with the host's Debian node, npm, go, cargo and rustc"
EOF
podman build --pull=never --quiet --network none -t "$image" "$work/ctx" >/dev/null

# Each tool starts (cargo needs rustc -vV; npm is a node script).
out=$(podman run --rm --pull=never --network none --entrypoint /bin/sh "$image" -c \
  'set -e; node --version; npm --version; go version; cargo --version; rustc -vV | head -n 1' \
  2>&1) || die "a tool does not start in $image: $out"
log "$(printf '%s' "$out" | tr '\n' ' ')"
finish_image "$image"
