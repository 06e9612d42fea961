#!/usr/bin/env bash
# worker/benches/engines.sh - start-up cost of every engine, bare and through the worker.
#
# Usage:  bash worker/benches/engines.sh          (as root, from anywhere in the repository)
#
# For each engine - bwrap, podman (runc), docker (runc), podman+runsc and docker+runsc
# (gVisor) - measures in one run:
#   1. the bare start of a trivial container of the offline test image (`true`), with the
#      sandbox flags the worker passes (network none, read-only, uid 1000, caps dropped,
#      memory/pids limits), timed by `hyperfine -N --warmup 2 --runs $RUNS`; bwrap runs
#      a plain `bwrap … true` over the exported root filesystem;
#   2. the worker's round trip of the same trivial job (sync POST /v1/worker/jobs:run,
#      command ["true"]), $RUNS requests one after the other (2 warm-up ones first),
#      each timed by curl.
#   3. podman-warm, docker-warm, podman-runsc-warm and docker-runsc-warm (gVisor): the
#      same round trip with the engine's warm pool on
#      (pool_size 2, filled for the test image at start; each request waits until a pooled
#      container is idle, so every measured job is a claim), and the claim-to-start time
#      (the worker's "warm job started" log line: mounts moved in, job sent, the waiter's
#      word that it execs). Their bare columns are the cold engine's bare start.
#   4. throughput: $THR_JOBS trivial jobs sent by $THR_CLIENTS concurrent clients
#      (queue.max_running 2, the default), jobs/s over the wall time and the p50/p95 of
#      their round trips. For the warm engines, the pool's claims and misses during it
#      (from /metrics): with more clients than pool_size some jobs run cold.
# Prints one table (p50/p95 in ms, and worker p50 / bare p50) and writes it as JSON to
# $OUT/engines-<UTC stamp>.json. The host's load average is printed with it: the numbers
# are only comparable within one run. Starts dockerd through deploy/docker/start.sh when
# none answers (it is left running; .ci/run stops the one a CI run started). Every worker
# is stopped on exit, and its state removed.
#
# Environment (defaults in brackets):
#   CARGO_TARGET_DIR  [/var/cache/cynode/target]
#   OUT               [/var/cache/cynode/bench/worker]
#   RUNS              [20]   measured runs per engine and mode
#   WORKER_BIN        [unset] a worker binary to measure instead of building the release one
#   ENGINES           [bwrap podman docker podman-runsc docker-runsc podman-warm docker-warm
#                      podman-runsc-warm docker-runsc-warm]
#   THR_JOBS          [40]   jobs per throughput run (0: no throughput runs)
#   THR_CLIENTS       [4]    concurrent clients in throughput runs (each job is one curl and
#                            two jq processes: bwrap's jobs/s here is bound by the client;
#                            compare.sh's stage 3 times bwrap with an in-process client)
#   RESULT            [$OUT/engines-<UTC stamp>.json]  where the JSON goes
# Needs: root, Debian 12; hyperfine, jq, curl (deploy/install-deps.sh installs them).
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}
[[ ${1:-} == -h || ${1:-} == --help ]] && usage 0
(($# == 0)) || usage 2
log() { printf 'engines: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cynode/target}
OUT=${OUT:-/var/cache/cynode/bench/worker}
RUNS=${RUNS:-20}
THR_JOBS=${THR_JOBS:-40}
THR_CLIENTS=${THR_CLIENTS:-4}
ENGINES=${ENGINES:-bwrap podman docker podman-runsc docker-runsc podman-warm docker-warm podman-runsc-warm docker-runsc-warm}
image=localhost/cynode-sba-test:latest
[[ $(id -u) -eq 0 ]] || die "must run as root"

if [[ -n ${WORKER_BIN:-} ]]; then
  worker_bin=$WORKER_BIN
else
  log "building the release worker"
  cargo build --release -q -p cynode-worker >&2
  worker_bin=$CARGO_TARGET_DIR/release/cynode-worker
fi
CYNODE_SKIP_SMOKE=1 bash deploy/install-deps.sh >/dev/null 2>&1
bin=$(bash deploy/sba/build-static.sh 2>/dev/null)
bash deploy/sba/build-test-image.sh "$bin" >/dev/null 2>&1
rootfs=$(bash deploy/sba/export-rootfs.sh "$image" 2>/dev/null)
bash deploy/docker/start.sh "$image"
waiter=$(bash deploy/worker/build-waiter.sh 2>/dev/null)

work=$(mktemp -d /var/tmp/cynode-engines.XXXXXX)
chmod 0755 "$work"
pids=()
cleanup() {
  local rc=$? p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  # The workers' disk volumes (loop-mounted ext4 on job directories and workspaces)
  # outlive a stopped worker: unmount them before the state goes.
  { grep -F " $work/" /proc/self/mountinfo || true; } | awk '{print $5}' | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
token=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')

# The flags the worker's engine backend passes (worker/src/backend/engine.rs run_args),
# less its seccomp profile, labels and volumes.
engine_flags=(--rm --pull=never --network=none --read-only --user=1000:1000 --cap-drop=ALL
  --security-opt=no-new-privileges --ulimit=nofile=1024:1024 --ulimit=nproc=4096:4096
  --memory=512m --memory-swap=512m --pids-limit=256 --cpus=1
  --tmpfs=/tmp:rw,size=64m,mode=1777 --entrypoint=true)

# bare_cmd ENGINE: the bare start, one shell word per argument, for hyperfine.
bare_cmd() {
  case $1 in
    bwrap) echo "bwrap --ro-bind $rootfs / --dev /dev --proc /proc --unshare-all --die-with-parent --uid 1000 --gid 1000 /bin/true" ;;
    podman | podman-warm) echo "podman run --runtime=runc ${engine_flags[*]} $image" ;;
    docker | docker-warm) echo "docker run ${engine_flags[*]} $image" ;;
    podman-runsc | podman-runsc-warm) echo "podman run --runtime=/usr/bin/runsc --runtime-flag=network=none ${engine_flags[*]} $image" ;;
    docker-runsc | docker-runsc-warm) echo "docker run --runtime=runsc ${engine_flags[*]} $image" ;;
  esac
}

# worker_config ENGINE: the backend lines of the worker's config.
worker_config() {
  case $1 in
    bwrap | podman | docker) echo "backend: $1" ;;
    podman-runsc) printf 'backend: podman\npodman:\n  runtime: runsc\n' ;;
    docker-runsc) printf 'backend: docker\ndocker:\n  runtime: runsc\n' ;;
    podman-warm | docker-warm)
      printf 'backend: %s\n%s:\n  pool_size: 2\n  pool_images: ["%s"]\n  pool_waiter: %s\n' \
        "${1%-warm}" "${1%-warm}" "$image" "$waiter"
      ;;
    podman-runsc-warm | docker-runsc-warm)
      printf 'backend: %s\n%s:\n  runtime: runsc\n  pool_size: 2\n  pool_images: ["%s"]\n  pool_waiter: %s\n' \
        "${1%-runsc-warm}" "${1%-runsc-warm}" "$image" "$waiter"
      ;;
  esac
}

# metric NAME: one of the worker's /metrics values, summed over its labels (0 when absent).
metric() {
  curl -sS -H "Authorization: Bearer $token" "http://$ADDR/metrics" |
    awk -v m="cynode_worker_$1" '{n = $1; sub(/\{.*/, "", n)} n == m {v += $2} END {print v + 0}'
}
pool_idle() { metric pool_idle; }

# one_job ID: sends one trivial job; prints its round trip in seconds (fails unless it
# completed).
one_job() {
  local body out
  body=$(jq -nc --arg id "$1" --arg image "$image" \
    '{version: 1, task_id: "bench", job_id: $id, sandbox: {image: $image, command: ["true"]}}')
  out=$(curl -sS -o "$work/resp-$1.json" -w '%{http_code} %{time_total}' \
    -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
    --data "$body" "http://$ADDR/v1/worker/jobs:run")
  [[ ${out%% *} == 200 && $(jq -r .status "$work/resp-$1.json") == completed ]] ||
    die "job $1: $out $(head -c 300 "$work/resp-$1.json")"
  rm -f "$work/resp-$1.json"
  echo "${out#* }"
}
export -f one_job die log

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
    echo "state_dir: $d/state"
    echo "token_file: $d/token"
    printf 'bwrap:\n  rootfs:\n    "%s": %s\n' "$image" "$rootfs"
  } >"$d/worker.yaml"
  "$worker_bin" serve --config "$d/worker.yaml" >/dev/null 2>"$d/worker.log" &
  pids+=($!)
  for _ in $(seq 600); do
    line=$(grep -m1 '"cynode-worker listening"' "$d/worker.log" 2>/dev/null || true)
    [[ -n $line ]] && break
    sleep 0.1
  done
  [[ -n $line && $(jq -r .fields.ready <<<"$line") == true ]] ||
    die "worker $1 did not start ready: $(tail -n 3 "$d/worker.log")"
  ADDR=$(jq -r .fields.addr <<<"$line")
}

# pct FILE P: the P-th percentile (nearest rank) of the numbers in FILE, in ms.
pct() { sort -n "$1" | awk -v p="$2" '{a[NR] = $1} END {i = int(NR * p / 100 + 0.999); if (i < 1) i = 1; printf "%.1f", a[i] * 1000}'; }

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
rows=()
for engine in $ENGINES; do
  log "$engine: bare"
  hyperfine -N --warmup 2 --runs "$RUNS" --export-json "$work/$engine.bare.json" \
    "$(bare_cmd "$engine")" >/dev/null 2>&1 || die "bare $engine failed: $(bare_cmd "$engine")"
  jq -r '.results[0].times[]' "$work/$engine.bare.json" >"$work/$engine.bare.txt"
  log "$engine: through the worker"
  start_worker "$engine"
  : >"$work/$engine.worker.txt"
  for i in $(seq -2 "$RUNS"); do
    if [[ $engine == *-warm ]]; then
      for _ in $(seq 600); do (($(pool_idle) >= 1)) && break; sleep 0.05; done
    fi
    t=$(one_job "bench-$engine-$i")
    ((i > 0)) && echo "$t" >>"$work/$engine.worker.txt"
  done
  thr=null
  if ((THR_JOBS > 0)); then
    log "$engine: throughput ($THR_JOBS jobs, $THR_CLIENTS clients)"
    claims0=$(metric pool_claims_total) misses0=$(metric pool_misses_total)
    t0=$(date +%s.%N)
    seq "$THR_JOBS" | ADDR=$ADDR token=$token image=$image work=$work \
      xargs -P "$THR_CLIENTS" -I{} bash -c 'one_job "thr-'"$engine"'-{}"' >"$work/$engine.thr.txt" ||
      die "$engine: a throughput job failed"
    t1=$(date +%s.%N)
    thr=$(jq -nc --argjson n "$THR_JOBS" --argjson c "$THR_CLIENTS" --argjson t0 "$t0" --argjson t1 "$t1" \
      --argjson p50 "$(pct "$work/$engine.thr.txt" 50)" --argjson p95 "$(pct "$work/$engine.thr.txt" 95)" \
      --argjson claims "$(($(metric pool_claims_total) - claims0))" \
      --argjson misses "$(($(metric pool_misses_total) - misses0))" \
      '{jobs: $n, clients: $c, wall_s: (($t1 - $t0) * 1000 | round / 1000),
        jobs_per_s: (($n / ($t1 - $t0)) * 100 | round / 100), p50_ms: $p50, p95_ms: $p95,
        pool_claims: $claims, pool_misses: $misses}')
  fi
  # The measured jobs' claim-to-start times (warm engines only, not the warm-up or the
  # throughput jobs), in seconds.
  grep '"warm job started"' "$work/$engine/worker.log" | grep '"sandbox":"cynode-bench-'"$engine"'-[1-9][0-9]*"' |
    jq -r '.fields.claim_to_start_us / 1000000' >"$work/$engine.start.txt" || true
  s50=null s95=null
  if [[ -s $work/$engine.start.txt ]]; then
    s50=$(pct "$work/$engine.start.txt" 50) s95=$(pct "$work/$engine.start.txt" 95)
  fi
  rows+=("$(jq -nc --arg e "$engine" --argjson s50 "$s50" --argjson s95 "$s95" --argjson thr "$thr" \
    --argjson b50 "$(pct "$work/$engine.bare.txt" 50)" --argjson b95 "$(pct "$work/$engine.bare.txt" 95)" \
    --argjson w50 "$(pct "$work/$engine.worker.txt" 50)" --argjson w95 "$(pct "$work/$engine.worker.txt" 95)" \
    '{engine: $e, bare_p50_ms: $b50, bare_p95_ms: $b95, worker_p50_ms: $w50, worker_p95_ms: $w95,
      ratio_p50: (($w50 / $b50) * 100 | round / 100), claim_to_start_p50_ms: $s50, claim_to_start_p95_ms: $s95,
      throughput: $thr}')")
done

mkdir -p "$OUT"
result=${RESULT:-$OUT/engines-$(date -u +%Y%m%dT%H%M%SZ).json}
printf '%s\n' "${rows[@]}" | jq -s --arg lb "$load_before" --arg la "$(cut -d' ' -f1-3 /proc/loadavg)" \
  --argjson runs "$RUNS" --arg kernel "$(uname -r)" --arg runsc "$(runsc --version 2>&1 | head -n 1)" \
  '{runs: $runs, load_before: $lb, load_after: $la, kernel: $kernel, runsc: $runsc, engines: .}' >"$result"
printf '%-14s %10s %10s %12s %12s %7s %12s %12s %9s %10s %10s\n' engine bare_p50 bare_p95 worker_p50 worker_p95 ratio start_p50 start_p95 jobs/s thr_p50 thr_p95
jq -r '.engines[] | [.engine, .bare_p50_ms, .bare_p95_ms, .worker_p50_ms, .worker_p95_ms, .ratio_p50,
    (.claim_to_start_p50_ms // "-"), (.claim_to_start_p95_ms // "-"),
    (.throughput.jobs_per_s // "-"), (.throughput.p50_ms // "-"), (.throughput.p95_ms // "-")] | @tsv' "$result" |
  while IFS=$'\t' read -r e b50 b95 w50 w95 r s50 s95 tj t50 t95; do
    printf '%-14s %8s ms %8s ms %10s ms %10s ms %6sx %9s ms %9s ms %9s %7s ms %7s ms\n' "$e" "$b50" "$b95" "$w50" "$w95" "$r" "$s50" "$s95" "$tj" "$t50" "$t95"
  done
echo "load average before: $load_before; after: $(cut -d' ' -f1-3 /proc/loadavg) ($RUNS runs each; $result)"
