#!/usr/bin/env bash
# worker/benches/session_state.sh - suspend, resume, snapshot and fork of a session with a
# 100 MiB workspace, per engine.
#
# Usage:  bash worker/benches/session_state.sh      (as root, from anywhere in the repository)
#
# For each engine, starts a cynode-worker on 127.0.0.1 (its state in a temporary
# directory), and RUNS times measures the time to interactive: `POST /v1/worker/sessions`
# of a new session (a new workspace) until its first exec (`true`) has answered, as
# computesdk/benchmarks times a sandbox (one timer in the client around the create and the
# first command): the sum of the two requests' round trips as curl times them (connect to
# the last byte), without the start of the client processes around them. On Podman and Docker the node has a warm pool of POOL_SIZE (a session claims
# an idle container; each measurement waits until one is idle, as a node with spare
# capacity has); POOL_SIZE=0 gives the cold figure. It then creates a session, writes
# WORKSPACE_MB MiB of random data into its workspace, and RUNS times:
#   0. exec: `POST …/exec` of `true` in the running session;
#   1. suspend: `POST …:suspend` round trip (the sandbox stopped, the record stored);
#   2. resume: `POST …:resume` round trip (goal: <= 150 ms), and resume to the first exec
#      answered (`true`), the two round trips added as for the time to interactive;
#   3. snapshot: `POST …/snapshots` round trip (tree hash of the 100 MiB, frozen image
#      copy);
#   4. fork: `POST /v1/worker/sessions {"from_snapshot": …}` round trip, a new workspace
#      (goal: <= 100 ms whatever the size), then its end and the snapshot's delete.
# Prints p50 and p95 (ms) per engine and step, with the `copy` the node reported, and
# writes them as JSON to $OUT/session-state-<UTC stamp>.json and
# $OUT/session-state-latest.json with the 1-minute load average before and after.
#
# Environment (defaults in brackets):
#   CARGO_TARGET_DIR   [/var/cache/cynode/target]
#   OUT                [/var/cache/cynode/bench/worker]
#   ENGINES            [bwrap podman docker podman-runsc]
#   RUNS               [10]
#   POOL_SIZE          [2]   podman.pool_size / docker.pool_size, filled for the image
#   WORKSPACE_MB       [100]
#   WORKER_BIN         [the release build]  a cynode-worker binary to measure instead
#   STATE_FS           []  `xfs`: the nodes' state directories on an XFS with reflink made
#                      for the run (a 4 GiB sparse image on a loop device), where snapshots
#                      and forks are `reflink`
# Needs: root, curl, jq, the test image (deploy/sba/build-test-image.sh).
set -euo pipefail

cd "$(dirname "$0")/../.."
# shellcheck source=deploy/lib.sh
source deploy/lib.sh # usage, log, die
[[ ${1:-} == -h || ${1:-} == --help ]] && usage 0
(($# == 0)) || usage 2

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cynode/target}
OUT=${OUT:-/var/cache/cynode/bench/worker}
ENGINES=${ENGINES:-bwrap podman docker podman-runsc}
RUNS=${RUNS:-10}
POOL_SIZE=${POOL_SIZE:-2}
WORKSPACE_MB=${WORKSPACE_MB:-100}
STATE_FS=${STATE_FS:-}
image=localhost/cynode-sba-test:latest
[[ $(id -u) -eq 0 ]] || die "must run as root"
for t in curl jq; do command -v "$t" >/dev/null || die "$t not found"; done

if [[ -n ${WORKER_BIN:-} ]]; then
  worker_bin=$WORKER_BIN
else
  log "building the release worker"
  cargo build --release -q -p cynode-worker >&2
  worker_bin=$CARGO_TARGET_DIR/release/cynode-worker
fi
rootfs=$(bash deploy/sba/export-rootfs.sh "$image" 2>/dev/null)
case " $ENGINES " in *" docker "*) bash deploy/docker/start.sh "$image" ;; esac

work=$(mktemp -d /var/tmp/cynode-session-state.XXXXXX)
chmod 0755 "$work"
state_root=$work
pids=()
cleanup() {
  local rc=$? p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 300); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  { grep -F " $work/" /proc/self/mountinfo || true; } | awk '{print $5}' | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
case $STATE_FS in
  '') ;;
  xfs)
    truncate -s 4G "$work/xfs.img"
    mkfs.xfs -q -m reflink=1 "$work/xfs.img"
    mkdir "$work/xfs"
    mount -o loop "$work/xfs.img" "$work/xfs"
    chmod 0755 "$work/xfs"
    state_root=$work/xfs
    ;;
  *) die "STATE_FS is '' or xfs, not $STATE_FS" ;;
esac
token=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')

worker_config() {
  local pool="  pool_size: $POOL_SIZE\n  pool_images: [\"$image\"]\n"
  case $1 in
    bwrap) echo "backend: $1" ;;
    podman | docker) printf "backend: %s\n%s:\n$pool" "$1" "$1" ;;
    podman-runsc) printf "backend: podman\npodman:\n  runtime: runsc\n$pool" ;;
    *) die "unknown engine $1" ;;
  esac
}

# wait_idle: until the node's pool has an idle container (bounded; none when it has no pool).
wait_idle() {
  local idle
  ((POOL_SIZE > 0)) || return 0
  for _ in $(seq 200); do
    idle=$(curl -sS -H "Authorization: Bearer $token" "http://$ADDR/metrics" |
      awk '/^cynode_worker_pool_idle\{/ {print $2}')
    [[ -z $idle || $idle -ge 1 ]] && return 0
    sleep 0.05
  done
}

# start_worker ENGINE: starts a worker; sets ADDR.
start_worker() {
  local d=$work/$1 line
  mkdir -p "$d"
  chmod 0755 "$d"
  printf '%s\n' "$token" >"$d/token"
  chmod 0600 "$d/token"
  {
    echo "listen: 127.0.0.1:0"
    worker_config "$1"
    echo "state_dir: $state_root/$1/state"
    echo "token_file: $d/token"
    printf 'bwrap:\n  rootfs:\n    "%s": %s\n' "$image" "$rootfs"
    printf 'limits:\n  disk_mb: %d\n' $((WORKSPACE_MB * 3))
  } >"$d/worker.yaml"
  "$worker_bin" serve --config "$d/worker.yaml" >/dev/null 2>"$d/worker.log" &
  pids+=($!)
  for _ in $(seq 600); do
    line=$(grep -m1 '"cynode-worker listening"' "$d/worker.log" 2>/dev/null || true)
    [[ -n $line ]] && break
    sleep 0.1
  done
  [[ -n $line ]] || die "worker $1 did not start: $(tail -n 3 "$d/worker.log")"
  ADDR=$(jq -r .fields.addr <<<"$line")
}

# call METHOD PATH [BODY]: the response body on stdout, the round trip (s) in $work/t.
call() {
  curl -sS -X "$1" -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
    --data "${3:-{\}}" -o "$work/body" -w '%{time_total}\n' "http://$ADDR$2" >"$work/t"
  cat "$work/body"
}

# pct FILE P: the P-th percentile (nearest rank) of the seconds in FILE, in ms.
pct() { sort -n "$1" | awk -v p="$2" '{a[NR] = $1} END {i = int(NR * p / 100 + 0.999); if (i < 1) i = 1; printf "%.1f", a[i] * 1000}'; }

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
results='[]'
for engine in $ENGINES; do
  log "$engine"
  start_worker "$engine"
  sid=bench-$engine-$$
  task=bench-task-$$
  : >"$work/$engine.tti"
  for i in $(seq "$RUNS"); do
    tid=tti-$engine-$$-$i
    wait_idle
    call POST /v1/worker/sessions \
      "{\"version\":1,\"session_id\":\"$tid\",\"task_id\":\"$task-$engine\",\"image\":\"$image\",\"workspace_id\":\"$tid\"}" |
      jq -e '.status == "running"' >/dev/null || die "$engine: create: $(cat "$work/body")"
    t_create=$(cat "$work/t")
    call POST "/v1/worker/sessions/$tid/exec" '{"version":1,"command":["true"]}' |
      jq -e '.status == "completed"' >/dev/null || die "$engine: first exec: $(cat "$work/body")"
    echo "$t_create + $(cat "$work/t")" | bc >>"$work/$engine.tti"
    call POST "/v1/worker/sessions/$tid/end" >/dev/null
  done
  call POST /v1/worker/sessions \
    "{\"version\":1,\"session_id\":\"$sid\",\"task_id\":\"$task-$engine\",\"image\":\"$image\",\"idle_timeout_seconds\":3600}" |
    jq -e '.status == "running"' >/dev/null || die "$engine: create: $(cat "$work/body")"
  call POST "/v1/worker/sessions/$sid/exec" \
    "{\"version\":1,\"command\":[\"sh\",\"-c\",\"head -c $((WORKSPACE_MB << 20)) /dev/urandom > /workspace/blob && sync\"],\"timeout_seconds\":300}" |
    jq -e '.status == "completed"' >/dev/null || die "$engine: fill: $(cat "$work/body")"
  for f in exec suspend resume first_exec snapshot fork; do : >"$work/$engine.$f"; done
  for i in $(seq "$RUNS"); do
    call POST "/v1/worker/sessions/$sid/exec" '{"version":1,"command":["true"]}' |
      jq -e '.status == "completed"' >/dev/null || die "$engine: exec: $(cat "$work/body")"
    cat "$work/t" >>"$work/$engine.exec"
  done
  copy=
  for i in $(seq "$RUNS"); do
    call POST "/v1/worker/sessions/$sid:suspend" | jq -e '.status == "suspended"' >/dev/null ||
      die "$engine: suspend: $(cat "$work/body")"
    cat "$work/t" >>"$work/$engine.suspend"
    wait_idle
    call POST "/v1/worker/sessions/$sid:resume" | jq -e '.status == "running"' >/dev/null ||
      die "$engine: resume: $(cat "$work/body")"
    t_resume=$(cat "$work/t")
    echo "$t_resume" >>"$work/$engine.resume"
    call POST "/v1/worker/sessions/$sid/exec" '{"version":1,"command":["true"]}' |
      jq -e '.status == "completed"' >/dev/null || die "$engine: exec after resume: $(cat "$work/body")"
    echo "$t_resume + $(cat "$work/t")" | bc >>"$work/$engine.first_exec"
    snap=$(call POST "/v1/worker/sessions/$sid/snapshots" | jq -r .snapshot_id)
    [[ $snap == snap-* ]] || die "$engine: snapshot: $(cat "$work/body")"
    cat "$work/t" >>"$work/$engine.snapshot"
    fid=fork-$engine-$$-$i
    wait_idle
    copy=$(call POST /v1/worker/sessions \
      "{\"version\":1,\"session_id\":\"$fid\",\"task_id\":\"$task-$engine\",\"image\":\"$image\",\"workspace_id\":\"$fid\",\"from_snapshot\":\"$snap\"}" |
      jq -r .workspace_copy)
    [[ $copy == copy || $copy == reflink ]] || die "$engine: fork: $(cat "$work/body")"
    cat "$work/t" >>"$work/$engine.fork"
    call POST "/v1/worker/sessions/$fid/end" >/dev/null
    call DELETE "/v1/worker/snapshots/$snap" >/dev/null
  done
  row=$(jq -n --arg engine "$engine" --arg copy "$copy" --argjson mb "$WORKSPACE_MB" \
    --arg t50 "$(pct "$work/$engine.tti" 50)" --arg t95 "$(pct "$work/$engine.tti" 95)" \
    --arg x50 "$(pct "$work/$engine.exec" 50)" --arg x95 "$(pct "$work/$engine.exec" 95)" \
    --arg s50 "$(pct "$work/$engine.suspend" 50)" --arg s95 "$(pct "$work/$engine.suspend" 95)" \
    --arg r50 "$(pct "$work/$engine.resume" 50)" --arg r95 "$(pct "$work/$engine.resume" 95)" \
    --arg e50 "$(pct "$work/$engine.first_exec" 50)" --arg e95 "$(pct "$work/$engine.first_exec" 95)" \
    --arg n50 "$(pct "$work/$engine.snapshot" 50)" --arg n95 "$(pct "$work/$engine.snapshot" 95)" \
    --arg f50 "$(pct "$work/$engine.fork" 50)" --arg f95 "$(pct "$work/$engine.fork" 95)" \
    '{engine: $engine, workspace_mb: $mb, copy: $copy,
      time_to_interactive_ms: {p50: ($t50|tonumber), p95: ($t95|tonumber)},
      exec_ms: {p50: ($x50|tonumber), p95: ($x95|tonumber)},
      suspend_ms: {p50: ($s50|tonumber), p95: ($s95|tonumber)},
      resume_ms: {p50: ($r50|tonumber), p95: ($r95|tonumber)},
      resume_to_first_exec_ms: {p50: ($e50|tonumber), p95: ($e95|tonumber)},
      snapshot_ms: {p50: ($n50|tonumber), p95: ($n95|tonumber)},
      fork_ms: {p50: ($f50|tonumber), p95: ($f95|tonumber)}}')
  printf '%s\n' "$row" | jq -c . >&2
  results=$(jq --argjson r "$row" '. + [$r]' <<<"$results")
  call POST "/v1/worker/sessions/$sid/end" >/dev/null
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
mkdir -p "$OUT"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
jq -n --argjson results "$results" --arg before "$load_before" --arg after "$load_after" \
  --arg date "$stamp" --argjson runs "$RUNS" --arg bin "$worker_bin" --arg fs "${STATE_FS:-default}" \
  --argjson pool "$POOL_SIZE" \
  '{date: $date, runs: $runs, worker: $bin, state_fs: $fs, pool_size: $pool, load_before: $before, load_after: $after, results: $results}' \
  >"$OUT/session-state-$stamp.json"
cp "$OUT/session-state-$stamp.json" "$OUT/session-state-latest.json"
jq . "$OUT/session-state-latest.json"
