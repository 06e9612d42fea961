#!/usr/bin/env bash
# deploy/llm/stop.sh - stop the llama-server that deploy/llm/start.sh started on PORT.
#
# Usage:  deploy/llm/stop.sh [PORT]      (PORT defaults to 8089)
#
# Reads ${CYNODE_LLM_CACHE:-/var/cache/cynode/llm}/run/llama-server-PORT.pid and, when it
# names a live llama-server (not a recycled pid), sends SIGTERM (requests in flight may
# finish), a second SIGTERM after 5 s, SIGKILL after 2 s more; then removes the pid file.
# A server this script did not start (no pid file) is left alone. Exit 0 when no server
# of start.sh's runs on PORT afterwards; one line on stderr says what was done.
set -euo pipefail

PORT="${1:-8089}"
if ! [[ "$PORT" =~ ^[0-9]+$ ]] || ((PORT < 1 || PORT > 65535)); then
  echo "usage: $0 [PORT]" >&2
  exit 2
fi
CACHE="${CYNODE_LLM_CACHE:-/var/cache/cynode/llm}"
PID_FILE="$CACHE/run/llama-server-$PORT.pid"

log() { printf 'llm-stop: %s\n' "$*" >&2; }

# Running (a zombie, ended but not yet reaped by its parent, counts as gone).
alive() {
  local state
  state="$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)"
  [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

pid="$(cat "$PID_FILE" 2>/dev/null || true)"
if ! [[ "$pid" =~ ^[0-9]+$ ]] || ! alive "$pid" ||
  ! tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q 'llama-server'; then
  rm -f "$PID_FILE"
  log "no llama-server of start.sh runs on port $PORT"
  exit 0
fi

kill -TERM "$pid" 2>/dev/null || true
for _ in $(seq 1 50); do alive "$pid" || break; sleep 0.1; done
if alive "$pid"; then
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 20); do alive "$pid" || break; sleep 0.1; done
fi
if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
rm -f "$PID_FILE"
log "stopped llama-server pid $pid on port $PORT"
