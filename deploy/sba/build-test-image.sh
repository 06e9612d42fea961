#!/usr/bin/env bash
# deploy/sba/build-test-image.sh - build the tiny cynode-sba test image offline.
#
# Usage:  deploy/sba/build-test-image.sh SBA_BINARY [IMAGE_NAME]
#   SBA_BINARY  the cynode-sba binary to put at /usr/local/bin/cynode-sba. Statically
#               linked is best; a dynamically linked one works too: the shared libraries
#               `ldd` lists for it are copied into the image beside it.
#   IMAGE_NAME  default localhost/cynode-sba-test:latest
#
# Nothing is pulled from a registry. The root filesystem is made from busybox-static
# (every applet symlinked, merged-/usr layout so /bin/X and /usr/bin/X both resolve),
# /etc/passwd and /etc/group with the non-root user `sandbox` (uid/gid 1000, HOME
# /home/sandbox), /workspace and /job owned by 1000, /tmp mode 1777; then
# `podman import` turns it into an image with ENTRYPOINT ["/usr/local/bin/cynode-sba"],
# USER 1000:1000, WORKDIR /workspace and the labels
# io.cynodeai.sandbox.agent-compatible=true and io.cynodeai.sandbox.purpose=test.
#
# Idempotent: the image carries the binary's sha256 (label io.cynode.sba.sha256) and a
# hash of this recipe (label io.cynode.image.recipe); when an image of that name exists
# with both matching, nothing is rebuilt. Concurrent runs for one image name serialise on
# a lock file. A replaced image is removed unless a container still uses it.
#
# Output: the image id on stdout (only that); progress on stderr.
# Environment:
#   CYNODE_IMAGE_FORCE=1  rebuild even when the image is up to date
#   BUSYBOX=PATH          static busybox to use (default: /bin/busybox from busybox-static)
# Needs: root, podman, busybox-static (deploy/install-deps.sh installs both).
set -euo pipefail

# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

[[ ${1:-} == -h || ${1:-} == --help ]] && usage 0
(($# >= 1 && $# <= 2)) || usage 2
sba_binary=$1
image=${2:-localhost/cynode-sba-test:latest}
busybox=${BUSYBOX:-/bin/busybox}

[[ $(id -u) -eq 0 ]] || die "must run as root (files owned by uid 1000, root's podman store)"
command -v podman >/dev/null || die "podman not found: run deploy/install-deps.sh"
[[ -f $sba_binary && -x $sba_binary ]] || die "SBA_BINARY '$sba_binary' is not an executable file"
[[ -x $busybox ]] || die "$busybox not found: apt-get install busybox-static"
if ldd "$busybox" 2>/dev/null | grep -q '=>'; then
  die "$busybox is dynamically linked: install busybox-static (or set BUSYBOX)"
fi


sba_sha=$(sha256sum "$sba_binary" | cut -d' ' -f1)
recipe_sha=$(cat "$0" "$busybox" | sha256sum | cut -d' ' -f1)

lock_image "$image"

exit_if_image_current "$image" "$sba_sha" "$recipe_sha" "${CYNODE_IMAGE_FORCE:-0}"

work=$(mktemp -d /var/tmp/cynode-test-image.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
log "building $image from $sba_binary (sha256 ${sba_sha:0:12}) in $root"

# Merged-/usr layout, as Debian does: /bin, /sbin, /lib, /lib64 point into /usr.
mkdir -p "$root"/usr/{bin,sbin,lib,lib64,local/bin} "$root"/{etc,dev,proc,sys,run,root,home/sandbox,workspace,job,tmp,var/tmp}
for d in bin sbin lib lib64; do ln -s "usr/$d" "$root/$d"; done

install -m 0755 "$busybox" "$root/usr/bin/busybox"
# Every applet busybox knows, in /usr/bin or /usr/sbin (so also /bin and /sbin).
while read -r applet_path; do
  name=${applet_path##*/}
  case $applet_path in
    *sbin/*) target=$root/usr/sbin/$name link=../bin/busybox ;;
    *) target=$root/usr/bin/$name link=busybox ;;
  esac
  [[ -e $target || -L $target ]] || ln -s "$link" "$target"
done < <("$busybox" --list-full)
for applet in sh true false echo cat sleep ls env id ps; do
  [[ -e $root/usr/bin/$applet ]] || die "busybox has no '$applet' applet"
done

install -m 0755 "$sba_binary" "$root/usr/local/bin/cynode-sba"
linkage=static
# A dynamically linked binary: copy its loader and libraries (paths kept).
while read -r lib; do
  linkage=dynamic
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done < <(ldd "$sba_binary" 2>/dev/null | grep -o '/[^ ]* (0x' | sed 's/ (0x$//' | sort -u)
log "cynode-sba is $linkage"

cat >"$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
sandbox:x:1000:1000:CyNode sandbox:/home/sandbox:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat >"$root/etc/group" <<'EOF'
root:x:0:
sandbox:x:1000:
nogroup:x:65534:
EOF
cat >"$root/etc/nsswitch.conf" <<'EOF'
passwd: files
group: files
hosts: files dns
EOF
cat >"$root/etc/os-release" <<'EOF'
NAME="CyNode SBA test image"
ID=cynode-sba-test
PRETTY_NAME="CyNode SBA test image (busybox)"
EOF
touch "$root/etc/hosts" "$root/etc/resolv.conf"
chmod 0644 "$root"/etc/{passwd,group,nsswitch.conf,os-release,hosts,resolv.conf}
chmod 0700 "$root/root"
chmod 1777 "$root/tmp" "$root/var/tmp"
chown 1000:1000 "$root/home/sandbox" "$root/workspace" "$root/job"
chmod 0755 "$root/home/sandbox" "$root/workspace" "$root/job"

tar --numeric-owner -C "$root" -cf - . |
  podman import --quiet \
    --change 'ENTRYPOINT ["/usr/local/bin/cynode-sba"]' \
    --change 'USER 1000:1000' \
    --change 'WORKDIR /workspace' \
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/usr/sbin:/bin:/sbin' \
    --change 'ENV HOME=/home/sandbox' \
    --change 'LABEL io.cynodeai.sandbox.agent-compatible=true' \
    --change 'LABEL io.cynodeai.sandbox.purpose=test' \
    --change "LABEL io.cynode.sba.sha256=$sba_sha" \
    --change "LABEL io.cynode.sba.linkage=$linkage" \
    --change "LABEL io.cynode.image.recipe=$recipe_sha" \
    --change 'LABEL org.opencontainers.image.title=cynode-sba-test' \
    --change 'LABEL org.opencontainers.image.description=busybox-based CyNode SBA test image' \
    --message "cynode-sba test image (sba sha256 $sba_sha)" \
    - "$image" >/dev/null

finish_image "$image"
