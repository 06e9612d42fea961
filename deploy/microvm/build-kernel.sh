#!/usr/bin/env bash
# deploy/microvm/build-kernel.sh - the microvm backend's guest kernel and VMM: installs
# QEMU (qemu-system-x86, machine type microvm), squashfs-tools and Debian's
# linux-source-6.1 with its build tools, then builds a minimal guest kernel from that
# source package (nothing is downloaded but Debian packages).
#
# Usage:  deploy/microvm/build-kernel.sh      (no arguments; root, or sudo, for apt)
#
# The kernel starts from `make tinyconfig` plus deploy/microvm/guest-kernel.config
# (64-bit, SMP, kvm-clock, virtio-mmio with blk/console/9p, squashfs, seccomp, cgroups;
# no modules, no /dev/mem, no PCI, no ACPI, no network driver). Every `=y` line of the
# fragment is checked in the final .config.
#
# Cached under ${CYNODE_MICROVM_CACHE:-/var/cache/cynode/microvm}:
#   kernel-<key>/vmlinux   the guest kernel (ELF with a PVH entry, what the worker boots);
#   kernel-<key>/bzImage   the same kernel compressed; <key> is the first 16 hex digits of
#                          the sha256 of the fragment, this script and the source version;
#   kernel-<key>/config    its .config; kernel-<key>/build-seconds how long it took;
#   vmlinux, vmlinuz       links to the newest vmlinux (the worker's default kernel) and
#                          bzImage;
#   .build.lock            flock(1) lock: concurrent callers take turns.
# Idempotent: a repeat run with the same key prints the cached path in well under a
# second. The first run takes several minutes (niced, CYNODE_MICROVM_JOBS=2 jobs).
#
# Output: `MICROVM_KERNEL=<path of vmlinux>` on stdout; progress on stderr.
set -euo pipefail
cd "$(dirname "$0")"
HERE=$PWD
CACHE="${CYNODE_MICROVM_CACHE:-/var/cache/cynode/microvm}"
JOBS="${CYNODE_MICROVM_JOBS:-2}"
FRAGMENT="$HERE/guest-kernel.config"
SOURCE_PKG=linux-source-6.1
PACKAGES=(qemu-system-x86 squashfs-tools "$SOURCE_PKG" bc flex bison libelf-dev make gcc
  libc6-dev xz-utils)

log() { printf 'build-kernel: [%3ds] %s\n' "$SECONDS" "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

is_installed() {
  [[ $(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null) == "ii"* ]]
}

# --- 1. packages ---------------------------------------------------------------------
missing=()
for pkg in "${PACKAGES[@]}"; do
  is_installed "$pkg" || missing+=("$pkg")
done
if ((${#missing[@]} > 0)); then
  sudo=()
  if [[ $EUID -ne 0 ]]; then
    command -v sudo >/dev/null || die "missing ${missing[*]} and not root"
    sudo=(sudo -n)
  fi
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends \
    "${missing[@]}" >&2; then
    "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 update -q >&2
    "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends \
      "${missing[@]}" >&2
  fi
fi

# /dev/kvm: the VMM runs as the sandbox user (uid 1000) with the kvm group, never as
# root. Debian's udev rule gives /dev/kvm to group kvm, mode 0660; machines without udev
# (containers, microVMs) get the same here.
if [[ -c /dev/kvm && $EUID -eq 0 ]]; then
  getent group kvm >/dev/null || groupadd --system kvm
  if [[ $(stat -c %G:%a /dev/kvm) != kvm:660 ]]; then
    chgrp kvm /dev/kvm && chmod 0660 /dev/kvm
    log "/dev/kvm: group kvm, mode 0660"
  fi
fi

# --- 2. the kernel -------------------------------------------------------------------
src_version=$(dpkg-query -W -f='${Version}' "$SOURCE_PKG")
key=$(cat "$FRAGMENT" "$HERE/build-kernel.sh" <(echo "$src_version") | sha256sum | cut -c1-16)
out="$CACHE/kernel-$key"
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
if ! flock -n 9; then
  log "another build is running; waiting for $CACHE/.build.lock"
  flock 9
fi

if [[ ! -s $out/vmlinux ]]; then
  tarball=/usr/src/$SOURCE_PKG.tar.xz
  [[ -f $tarball ]] || die "$tarball missing (package $SOURCE_PKG)"
  work=$(mktemp -d "$CACHE/.work.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  log "unpacking $tarball ($src_version)"
  # The documentation (but Documentation/Kconfig) and the other architectures' device
  # trees are not needed: leaving them out saves a third of what is written. (Other
  # arches' Kconfig files are: the crypto menu sources them.)
  excludes=("Documentation/*/*")
  for a in arc arm arm64 csky loongarch microblaze mips nios2 openrisc powerpc riscv sh xtensa; do
    excludes+=("arch/$a/boot/dts")
  done
  tar -xJf "$tarball" -C "$work" "${excludes[@]/#/--exclude=$SOURCE_PKG/}"
  tree="$work/$SOURCE_PKG"
  [[ -f $tree/Makefile ]] || die "no kernel tree in $tarball"
  kmake() { nice -n 19 make -C "$tree" ARCH=x86_64 "$@" >&2; }
  kmake tinyconfig
  # The fragment's options on top, then Kconfig resolves the rest.
  while IFS= read -r line; do
    case $line in
    CONFIG_*=*)
      name=${line%%=*}
      value=${line#*=}
      "$tree/scripts/config" --file "$tree/.config" --set-val "${name#CONFIG_}" "$value"
      ;;
    "# CONFIG_"*" is not set")
      name=${line#\# }
      name=${name%% *}
      "$tree/scripts/config" --file "$tree/.config" --disable "${name#CONFIG_}"
      ;;
    esac
  done <"$FRAGMENT"
  kmake olddefconfig
  bad=()
  while IFS= read -r line; do
    case $line in
    CONFIG_*=y) grep -qx "$line" "$tree/.config" || bad+=("$line") ;;
    "# CONFIG_"*" is not set")
      name=${line#\# }
      name=${name%% *}
      ! grep -q "^$name=" "$tree/.config" || bad+=("$name (must be off)")
      ;;
    esac
  done <"$FRAGMENT"
  ((${#bad[@]} == 0)) || die "Kconfig did not keep: ${bad[*]}"
  log "building bzImage with $JOBS jobs at nice 19 (several minutes)"
  build_start=$SECONDS
  kmake -j"$JOBS" bzImage
  mkdir -p "$work/out"
  cp "$tree/arch/x86/boot/bzImage" "$work/out/bzImage"
  # The uncompressed ELF, booted through its PVH entry note (what the worker uses).
  objcopy --strip-debug "$tree/vmlinux" "$work/out/vmlinux"
  cp "$tree/.config" "$work/out/config"
  echo $((SECONDS - build_start)) >"$work/out/build-seconds"
  rm -rf "$out"
  mv "$work/out" "$out"
  log "built $out/bzImage ($(stat -c %s "$out/bzImage") bytes) in $(cat "$out/build-seconds") s"
else
  log "kernel cached: $out/vmlinux"
fi
ln -sfn "kernel-$key/bzImage" "$CACHE/vmlinuz"
ln -sfn "kernel-$key/vmlinux" "$CACHE/vmlinux"
printf 'MICROVM_KERNEL=%s\n' "$out/vmlinux"
