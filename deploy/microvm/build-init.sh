#!/usr/bin/env bash
# deploy/microvm/build-init.sh - builds cynode-vminit, PID 1 of the microvm backend's
# guests, statically linked (the same flags as deploy/sba/build-static.sh, so the two share
# their dependency builds), and copies it to ${CYNODE_MICROVM_CACHE:-/var/cache/cynode/microvm}/cynode-vminit,
# where the worker looks for it by default. Prints that path on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cynode/target}"
CACHE="${CYNODE_MICROVM_CACHE:-/var/cache/cynode/microvm}"
RUSTFLAGS="-C target-feature=+crt-static --remap-path-prefix=$PWD=/cynode" \
  cargo build --release -p cynode-vminit --target x86_64-unknown-linux-gnu >&2
bin="$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cynode-vminit"
if ldd "$bin" 2>&1 | grep -q '=>'; then
  echo "build-init: $bin has dynamic dependencies" >&2
  exit 1
fi
mkdir -p "$CACHE"
if ! cmp -s "$bin" "$CACHE/cynode-vminit"; then
  # A temporary name of this run's own: two concurrent runs never share one.
  tmp=$(mktemp "$CACHE/.cynode-vminit.XXXXXX")
  cp "$bin" "$tmp"
  chmod 0755 "$tmp"
  mv -f "$tmp" "$CACHE/cynode-vminit"
fi
echo "build-init: $CACHE/cynode-vminit: static, $(stat -c %s "$bin") bytes" >&2
echo "$CACHE/cynode-vminit"
