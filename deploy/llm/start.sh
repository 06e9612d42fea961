#!/usr/bin/env bash
# deploy/llm/start.sh - start a local OpenAI-compatible LLM server (llama-server with
# SmolLM2-135M-Instruct, model alias "smollm2") on 127.0.0.1, in the background.
#
# Usage:  deploy/llm/start.sh [PORT]      (PORT defaults to 8089)
#
# Steps:
#   1. if something already answers http://127.0.0.1:PORT/v1/models and lists smollm2,
#      prints the URL line below and returns at once (idempotent);
#   2. runs setup.sh beside this file (cached: well under a second once it has run);
#   3. starts `llama-server -m MODEL --alias smollm2 --jinja -c ${CYNODE_LLM_CTX:-8192} -t 2
#      --host 127.0.0.1 --port PORT` detached (own session, stdin from /dev/null), with
#        pid  ${CYNODE_LLM_CACHE:-/var/cache/cynode/llm}/run/llama-server-PORT.pid
#        log  ${CYNODE_LLM_CACHE:-/var/cache/cynode/llm}/run/llama-server-PORT.log
#      (the thread count is CYNODE_LLM_THREADS, default 2; OMP_WAIT_POLICY defaults to
#      passive, see below);
#   4. waits until /v1/models answers (at most CYNODE_LLM_START_TIMEOUT seconds, default
#      and cap 120); on failure or time-out it kills the server it started, prints the
#      log's tail and exits 1.
#
# Output: one line on stdout, everything else on stderr:
#   CYNODE_MODEL_BASE_URL=http://127.0.0.1:PORT/v1
#
# Stop the server:  kill "$(cat /var/cache/cynode/llm/run/llama-server-8089.pid)"
#   (a first SIGTERM lets requests in flight finish; send a second one to end it at once)
set -euo pipefail

PORT="${1:-8089}"
if ! [[ "$PORT" =~ ^[0-9]+$ ]] || ((PORT < 1 || PORT > 65535)); then
  echo "usage: $0 [PORT]" >&2
  exit 2
fi
CACHE="${CYNODE_LLM_CACHE:-/var/cache/cynode/llm}"
TIMEOUT="${CYNODE_LLM_START_TIMEOUT:-120}"
THREADS="${CYNODE_LLM_THREADS:-2}"
# ggml's CPU backend runs its threads under OpenMP, whose default is to spin while it
# waits. When other work (cargo builds, test suites) shares the 2 cores, the spinning
# threads fight them and generation collapses: measured here under a load of ~6, 3-7
# tokens/s with the default against 25-50 tokens/s with passive waiting.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
((TIMEOUT > 120)) && TIMEOUT=120
ALIAS="smollm2"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BASE_URL="http://127.0.0.1:$PORT/v1"
RUN_DIR="$CACHE/run"
PID_FILE="$RUN_DIR/llama-server-$PORT.pid"
LOG_FILE="$RUN_DIR/llama-server-$PORT.log"

log() { printf 'llm-start: %s\n' "$*" >&2; }

# 0: our model answers; 1: nothing answers; 2: something else answers on the port.
probe() {
  local body
  body="$(curl -sf --max-time 2 "$BASE_URL/models" 2>/dev/null)" || return 1
  [[ "$body" == *"\"$ALIAS\""* ]] && return 0
  return 2
}

done_ok() {
  printf 'CYNODE_MODEL_BASE_URL=%s\n' "$BASE_URL"
  exit 0
}

# Is PID a live llama-server (not a recycled pid)?
is_our_server() {
  local pid="$1"
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null &&
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q 'llama-server'
}

# llama-server's first SIGTERM waits for requests in flight to finish (which can take
# minutes at a few tokens/s); a second one ends it at once; SIGKILL is the last resort.
stop_pid() {
  local pid="$1" _
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

rc=0
probe || rc=$?
if ((rc == 0)); then
  log "already up on port $PORT"
  done_ok
fi

mkdir -p "$RUN_DIR"
# Two callers for the same port take turns; the second then finds the server up.
exec 8>"$RUN_DIR/start-$PORT.lock"
flock 8

rc=0
probe || rc=$?
if ((rc == 0)); then
  log "already up on port $PORT"
  done_ok
elif ((rc == 2)); then
  log "error: something that is not llama-server/$ALIAS answers on port $PORT"
  exit 1
fi

# A server of ours from an earlier call that no longer answers: replace it.
if [[ -f "$PID_FILE" ]]; then
  old="$(cat "$PID_FILE" 2>/dev/null || true)"
  if is_our_server "$old"; then
    log "stopping unresponsive llama-server pid $old"
    stop_pid "$old"
  fi
  rm -f "$PID_FILE"
fi

setup_out="$("$HERE/setup.sh")"
LLAMA_SERVER="$(sed -n 's/^LLAMA_SERVER=//p' <<<"$setup_out")"
LLAMA_MODEL="$(sed -n 's/^LLAMA_MODEL=//p' <<<"$setup_out")"
[[ -x "$LLAMA_SERVER" && -s "$LLAMA_MODEL" ]] || {
  log "error: setup.sh gave no usable LLAMA_SERVER/LLAMA_MODEL"
  exit 1
}

log "starting $LLAMA_SERVER on 127.0.0.1:$PORT, $THREADS threads, OMP_WAIT_POLICY=$OMP_WAIT_POLICY (log $LOG_FILE)"
start_ns=$(date +%s%N)
# setsid: the server gets its own session, so it outlives this script's process group.
# Without job control `setsid` execs in place, so $! is the server's own pid.
# 8>&-: the server must not inherit the start lock, or it would hold it for its lifetime.
setsid "$LLAMA_SERVER" -m "$LLAMA_MODEL" --alias "$ALIAS" --jinja -c "${CYNODE_LLM_CTX:-8192}" -t "$THREADS" \
  --host 127.0.0.1 --port "$PORT" </dev/null >"$LOG_FILE" 2>&1 8>&- &
pid=$!
echo "$pid" >"$PID_FILE"

deadline=$((SECONDS + TIMEOUT))
while :; do
  rc=0
  probe || rc=$?
  if ((rc == 0)); then
    ms=$((($(date +%s%N) - start_ns) / 1000000))
    log "up on port $PORT (pid $pid) after ${ms} ms"
    done_ok
  fi
  if ! kill -0 "$pid" 2>/dev/null; then
    log "error: llama-server exited during startup; last lines of $LOG_FILE:"
    tail -n 30 "$LOG_FILE" >&2 || true
    rm -f "$PID_FILE"
    exit 1
  fi
  if ((SECONDS >= deadline)); then
    log "error: no answer on $BASE_URL/models within ${TIMEOUT}s; stopping pid $pid"
    stop_pid "$pid"
    tail -n 30 "$LOG_FILE" >&2 || true
    rm -f "$PID_FILE"
    exit 1
  fi
  sleep 0.25
done
