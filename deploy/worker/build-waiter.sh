#!/usr/bin/env bash
# deploy/worker/build-waiter.sh - builds cynode-pool-waiter, PID 1 of the worker's pooled
# (warm) Podman/Docker sandboxes (podman.pool_size / docker.pool_size), statically linked
# (the same flags as deploy/sba/build-static.sh), and copies it to
# ${CYNODE_WORKER_CACHE:-/var/cache/cynode/worker}/cynode-pool-waiter, where the worker looks
# for it by default (config `podman.pool_waiter`). Prints that path on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cynode/target}"
CACHE="${CYNODE_WORKER_CACHE:-/var/cache/cynode/worker}"
RUSTFLAGS="-C target-feature=+crt-static --remap-path-prefix=$PWD=/cynode" \
  cargo build --release -p cynode-poolwaiter --target x86_64-unknown-linux-gnu >&2
bin="$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cynode-pool-waiter"
if ldd "$bin" 2>&1 | grep -q '=>'; then
  echo "build-waiter: $bin has dynamic dependencies" >&2
  exit 1
fi
mkdir -p "$CACHE"
# Several test processes may run this at once: each copies through a temporary name of
# its own, and the rename is atomic.
if ! cmp -s "$bin" "$CACHE/cynode-pool-waiter"; then
  tmp=$(mktemp "$CACHE/.cynode-pool-waiter.XXXXXX")
  cp "$bin" "$tmp"
  chmod 0755 "$tmp"
  mv -f "$tmp" "$CACHE/cynode-pool-waiter"
fi
echo "build-waiter: $CACHE/cynode-pool-waiter: static, $(stat -c %s "$bin") bytes" >&2
echo "$CACHE/cynode-pool-waiter"
