#!/usr/bin/env bash
# Builds the statically linked release cynode-sba and checks it: static, under 20 MB.
# Prints the binary's path on stdout. CARGO_TARGET_DIR defaults to /var/cache/cynode/target.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cynode/target}"
# Paths are remapped so the binary (and so the test image built from its sha256) is the
# same whichever checkout built it.
RUSTFLAGS="-C target-feature=+crt-static --remap-path-prefix=$PWD=/cynode" \
  cargo build --release -p cynode-sba --target x86_64-unknown-linux-gnu >&2
bin="$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cynode-sba"
size=$(stat -c %s "$bin")
if ldd "$bin" 2>&1 | grep -q '=>'; then
  echo "build-static: $bin has dynamic dependencies" >&2
  ldd "$bin" >&2
  exit 1
fi
if ((size >= 20 * 1024 * 1024)); then
  echo "build-static: $bin is $size bytes, over the 20 MB budget" >&2
  exit 1
fi
echo "build-static: $bin: static, $size bytes" >&2
echo "$bin"
