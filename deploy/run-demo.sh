#!/usr/bin/env bash
# The main job of this repository today: install what is needed, build the static runner,
# build the offline sandbox image, and run examples/jobs/hello.json in a real Podman
# sandbox (no network, read-only root, non-root user, dropped capabilities), then print the
# result. The PM and the Worker API are later milestones; see README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cynode/target}"

bash deploy/install-deps.sh >&2
bin=$(bash deploy/sba/build-static.sh)
image=$(bash deploy/sba/build-test-image.sh "$bin")

work=$(mktemp -d /tmp/cynode-demo.XXXXXX)
mkdir -p "$work/workspace" "$work/job/artifacts"
cp examples/jobs/hello.json "$work/job/job.json"
chown -R 1000:1000 "$work"

set +e
podman run --rm --runtime runc --network none --read-only --user 1000:1000 \
  --cap-drop ALL --security-opt no-new-privileges --memory 256m --pids-limit 64 \
  --ulimit nofile=1024:1024 --ulimit nproc=1000:1000 \
  -v "$work/job:/job" -v "$work/workspace:/workspace" "$image" >"$work/log.jsonl"
code=$?
set -e
echo "cynode-sba exited $code; result (also in $work/job/result.json):"
cat "$work/job/result.json"
exit "$code"
