#!/usr/bin/env bash
# The main job of this repository, on embedded defaults: install what is needed, build the
# static runner, the sandbox image, cynode-pm and cynode-worker, start the local model
# (llama-server + SmolLM2-135M from the package registries, deploy/llm/) unless
# CYNODE_MODEL_BASE_URL names another OpenAI-compatible endpoint, and run one objective end
# to end with `cynode-pm run`: SQLite in a state directory, a local cynode-worker (Podman)
# started and stopped by the PM, a copy of examples/workspace as the session's workspace.
#
#   bash deploy/run-demo.sh [--keep-model] ["objective"]
#
# The model server: one this script started itself is stopped when it exits (on success,
# failure or Ctrl-C) unless --keep-model is given or CYNODE_DEMO_KEEP_MODEL=1 is set; one
# that was already running before (or an endpoint named by CYNODE_MODEL_BASE_URL) is left
# alone. Its last line on stderr always says whether a model server is left running, on
# which port, and how to stop it (bash deploy/llm/stop.sh PORT). The port is 8089, or
# CYNODE_DEMO_MODEL_PORT.
#
# The run's state directory and workspace copy are kept (for `cynode-pm sessions show`) in
# a new directory under /var/tmp, or under CYNODE_DEMO_DIR.
#
# SmolLM2-135M is tiny: it drives the real loop (schema-valid replies, jobs in a real
# sandbox) but is not clever; point CYNODE_MODEL_BASE_URL / CYNODE_MODEL_NAME at a larger
# model for real work. Exit code: cynode-pm's (0 completed, 1 failed, 3 waiting for an
# answer; `cynode-pm sessions resume ID --answer TEXT` continues it).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cynode/target}"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
keep_model="${CYNODE_DEMO_KEEP_MODEL:-0}"
objective=""
while (($#)); do
  case "$1" in
    --keep-model) keep_model=1 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; objective="${1:-}"; break ;;
    -*) echo "run-demo: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) objective="$1" ;;
  esac
  shift
done
objective="${objective:-List the files in the workspace, then finish with a one-sentence summary of what the project does.}"

# The model server's fate, said last whatever happens: none (an endpoint of the user's,
# or not reached yet), running before the demo (left alone), or started here (stopped
# unless kept).
model_port="${CYNODE_DEMO_MODEL_PORT:-8089}"
model_server=none
model_note() {
  local pid
  pid="$(cat "${CYNODE_LLM_CACHE:-/var/cache/cynode/llm}/run/llama-server-$model_port.pid" 2>/dev/null || echo '?')"
  case "$model_server" in
    none)
      if [[ -n ${CYNODE_MODEL_BASE_URL:-} ]]; then
        echo "run-demo: the model endpoint $CYNODE_MODEL_BASE_URL was not started by the demo; nothing to stop" >&2
      else
        echo "run-demo: no model server was started" >&2
      fi
      ;;
    before)
      echo "run-demo: the model server on 127.0.0.1:$model_port was running before the demo and is left running; stop it with: bash deploy/llm/stop.sh $model_port" >&2
      ;;
    started)
      if [[ $keep_model == 1 ]]; then
        echo "run-demo: the model server (llama-server pid $pid) is left running on 127.0.0.1:$model_port (--keep-model); stop it with: bash deploy/llm/stop.sh $model_port" >&2
      elif bash deploy/llm/stop.sh "$model_port" 2>/dev/null; then
        echo "run-demo: stopped the model server the demo started (llama-server pid $pid, port $model_port); none is left running" >&2
      else
        echo "run-demo: could not stop the model server (llama-server pid $pid) on 127.0.0.1:$model_port; stop it with: bash deploy/llm/stop.sh $model_port" >&2
      fi
      ;;
  esac
}
trap model_note EXIT
# Ctrl-C or a TERM: end with the conventional status; the EXIT trap still runs.
trap 'exit 130' INT
trap 'exit 143' TERM

bash deploy/install-deps.sh >&2
bin=$(bash deploy/sba/build-static.sh)
bash deploy/sba/build-test-image.sh "$bin" >/dev/null
cargo build --release -p cynode-pm -p cynode-worker >&2

if [[ -z ${CYNODE_MODEL_BASE_URL:-} ]]; then
  if curl -sf --max-time 2 "http://127.0.0.1:$model_port/v1/models" >/dev/null 2>&1; then
    model_server=before
  else
    # Marked before start.sh runs: a server it leaves behind on a failed start is ours.
    model_server=started
  fi
  export "$(bash deploy/llm/start.sh "$model_port")"
fi
echo "model endpoint: $CYNODE_MODEL_BASE_URL (${CYNODE_MODEL_NAME:-smollm2})" >&2

run=$(mktemp -d "${CYNODE_DEMO_DIR:-/var/tmp}/cynode-demo.XXXXXX")
chmod 0755 "$run"
cp -r examples/workspace "$run/workspace"
echo "state and workspace copy in $run" >&2
# Not exec: the EXIT trap must run after cynode-pm, with its status.
rc=0
"$CARGO_TARGET_DIR/release/cynode-pm" run "$objective" \
  --workspace "$run/workspace" --state-dir "$run/state" || rc=$?
exit "$rc"
