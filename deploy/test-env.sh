#!/usr/bin/env bash
# deploy/test-env.sh - prepare, once and before any test runs, everything the test suites
# use, so that no test spends its own time limit installing or building:
#   1. deploy/install-deps.sh     host tools (podman, runc, catatonit, bubblewrap, git, …)
#   2. deploy/sba/build-static.sh the static cynode-sba
#   3. deploy/sba/build-test-image.sh + export-rootfs.sh   the offline test image and its
#      root filesystem for bwrap; build-python-test-image.sh the same image plus the
#      host's Debian python3 and pip (a few seconds; the egress pip tests, both backends)
#      build-toolchain-test-image.sh the same image plus the host's node, npm, go, cargo
#      and rustc (about 95 s and 745 MB once; the npm/cargo/go fetch tests, both backends)
#   3a. deploy/worker/build-waiter.sh   the static pool waiter: PID 1 of the engines'
#      pooled containers, which `restricted` (egress) jobs on Podman and Docker use, and
#      the seccomp launcher of gVisor session commands
#   3b. deploy/docker/start.sh    a Docker daemon (started when none answers; its pid in
#      /var/cache/cynode/dockerd/started.pid) with the same test image loaded from podman
#   4. deploy/microvm/build-kernel.sh + build-init.sh   QEMU, the microvm guest kernel
#      (built from Debian's linux-source, cached) and the guest init
#   5. deploy/llm/setup.sh        llama-server and SmolLM2 (built, not started)
#   6. deploy/postgres/start.sh   a local PostgreSQL cluster (started if it is not running)
# Every step is cached and idempotent: a second run takes a few seconds. The tests call the
# same scripts themselves (cheap once this has run), so each still works on its own.
#
# nextest runs this as a setup script (.config/nextest.toml) before the integration test
# binaries; .ci/run runs it before the test command. Progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cynode/target}"
log() { printf 'test-env: [%4ds] %s\n' "$SECONDS" "$*" >&2; }

log "host dependencies"
CYNODE_SKIP_SMOKE="${CYNODE_SKIP_SMOKE:-1}" bash deploy/install-deps.sh >&2
log "static cynode-sba"
bin=$(bash deploy/sba/build-static.sh)
log "test image"
bash deploy/sba/build-test-image.sh "$bin" >/dev/null
bash deploy/sba/export-rootfs.sh localhost/cynode-sba-test:latest >/dev/null
bash deploy/sba/build-python-test-image.sh >/dev/null
bash deploy/sba/export-rootfs.sh localhost/cynode-sba-test-python:latest >/dev/null
bash deploy/sba/build-toolchain-test-image.sh >/dev/null
bash deploy/sba/export-rootfs.sh localhost/cynode-sba-test-toolchains:latest >/dev/null
log "pool waiter (the engines' warm and egress containers, gVisor sessions' seccomp)"
bash deploy/worker/build-waiter.sh >/dev/null
log "Docker daemon and the test image in it"
bash deploy/docker/start.sh localhost/cynode-sba-test:latest
log "microvm guest kernel, VMM and init"
bash deploy/microvm/build-kernel.sh >/dev/null
bash deploy/microvm/build-init.sh >/dev/null
log "local model server (build only)"
bash deploy/llm/setup.sh >/dev/null
log "PostgreSQL"
bash deploy/postgres/start.sh >/dev/null
log "ready"
