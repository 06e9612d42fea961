#!/usr/bin/env bash
# worker/benches/egress_engines.sh - what `network_policy: restricted` costs a trivial job
# on the OCI engines (Podman, Docker), cold and with the warm pool on.
#
# Usage:  bash worker/benches/egress_engines.sh      (as root, from anywhere in the repository)
#
# For each engine of ENGINES and each pool size of POOLS, starts the release cynode-worker
# (backend ENGINE, ENGINE.pool_size POOL, egress allowed to one origin on 127.0.0.1) and
# times RUNS pairs of sync jobs (command ["true"] on the test image), one without network
# and one `restricted`, alternating so load drift hits both alike. A restricted job
# starts in a pool waiter's container (made for it when none is idle). Prints p50/p95 of both and the extra,
# and writes JSON to $OUT/egress-engines-<stamp>.json. Starts dockerd when none answers
# (deploy/docker/start.sh) and stops it at the end only then. Needs: root, python3,
# the test image (deploy/test-env.sh), the pool waiter (deploy/worker/build-waiter.sh).
#
# Environment (defaults in brackets):
#   CARGO_TARGET_DIR   [/var/cache/cynode/target]
#   ENGINES            [podman docker]
#   POOLS              [0 2]
#   RUNS               [30]   pairs per engine and pool size (after 3 warm-up pairs)
#   OUT                [/var/cache/cynode/bench/worker]
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cynode/target}
ENGINES=${ENGINES:-podman docker}
POOLS=${POOLS:-0 2}
RUNS=${RUNS:-30}
OUT=${OUT:-/var/cache/cynode/bench/worker}
image=localhost/cynode-sba-test:latest
log() { printf 'egress-engines: %s\n' "$*" >&2; }
[[ $(id -u) -eq 0 ]] || { log "must run as root"; exit 1; }
cargo build --release -q -p cynode-worker
worker_bin=$CARGO_TARGET_DIR/release/cynode-worker
waiter=$(bash deploy/worker/build-waiter.sh 2>/dev/null)

work=$(mktemp -d /var/tmp/cynode-egress-engines.XXXXXX)
chmod 755 "$work"
pids=()
docker_started=0
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  findmnt -rn -o TARGET | grep "^$work/" | sort -r | xargs -r umount -l || true
  rm -rf "$work"
  if ((docker_started == 1)); then
    pid=$(cat /var/cache/cynode/dockerd/started.pid 2>/dev/null || true)
    [[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT
if [[ " $ENGINES " == *" docker "* ]]; then
  pidof dockerd >/dev/null || docker_started=1
  bash deploy/docker/start.sh "$image" >&2
fi

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 -m http.server --bind 127.0.0.1 "$port" --directory "$work" >/dev/null 2>&1 &
pids+=($!)
token=bench-token-0123456789abcdef
printf '%s' "$token" >"$work/token"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"
results=()
for engine in $ENGINES; do
  for pool in $POOLS; do
    state=$work/state-$engine-$pool
    cat >"$work/worker.yaml" <<YAML
listen: 127.0.0.1:0
backend: $engine
state_dir: $state
token_file: $work/token
$engine:
  pool_size: $pool
  pool_images: ["$image"]
  pool_waiter: $waiter
egress:
  allow: ["127.0.0.1:$port"]
YAML
    "$worker_bin" serve --config "$work/worker.yaml" 2>"$work/worker-$engine-$pool.log" &
    wpid=$!
    addr=
    for _ in $(seq 600); do
      addr=$(grep -o '"addr":"[^"]*"' "$work/worker-$engine-$pool.log" 2>/dev/null | head -n1 | cut -d'"' -f4 || true)
      [[ -n $addr ]] && break
      sleep 0.1
    done
    [[ -n $addr ]] || { log "the worker did not start: $(tail -n 5 "$work/worker-$engine-$pool.log")"; exit 1; }
    log "$engine pool $pool at $addr, load $(cut -d' ' -f1 /proc/loadavg)"
    results+=("$(ADDR=$addr TOKEN=$token IMAGE=$image RUNS=$RUNS ENGINE=$engine POOL=$pool python3 - <<'PY'
import json, os, time, urllib.request
addr, token, image, runs = os.environ["ADDR"], os.environ["TOKEN"], os.environ["IMAGE"], int(os.environ["RUNS"])
n = 0
def job(policy):
    global n
    n += 1
    body = {"version": 1, "task_id": f"t{n}", "job_id": f"ee-{os.getpid()}-{n}",
            "sandbox": {"image": image, "command": ["true"], "network_policy": policy,
                        "timeout_seconds": 120}}
    req = urllib.request.Request(f"http://{addr}/v1/worker/jobs:run", data=json.dumps(body).encode(),
        method="POST", headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        resp = json.load(r)
    assert resp["status"] == "completed", resp
    return (time.perf_counter() - t) * 1000
def pct(xs, p):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]
for _ in range(3):
    job("none"); job("restricted")
off, on = [], []
for i in range(runs):
    # The pool (when on) refills between jobs: wait for it as a steady stream would.
    if os.environ["POOL"] != "0":
        time.sleep(1.0)
    if i % 2:
        off.append(job("none")); on.append(job("restricted"))
    else:
        on.append(job("restricted")); off.append(job("none"))
print(json.dumps({"engine": os.environ["ENGINE"], "pool_size": int(os.environ["POOL"]), "runs": runs,
    "load": open("/proc/loadavg").read().split()[0],
    "none_ms": {"p50": pct(off, 50), "p95": pct(off, 95)},
    "restricted_ms": {"p50": pct(on, 50), "p95": pct(on, 95)},
    "extra_p50_ms": pct(on, 50) - pct(off, 50)}))
PY
)")
    kill "$wpid" 2>/dev/null || true
    wait "$wpid" 2>/dev/null || true
    findmnt -rn -o TARGET | grep "^$state/" | sort -r | xargs -r umount -l || true
  done
done
printf '%s\n' "${results[@]}" | python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
print(json.dumps(rows, indent=1))
for r in rows:
    print("| %s | pool %d | load %s | none p50 %.1f / p95 %.1f ms | restricted p50 %.1f / p95 %.1f ms | extra p50 %.1f ms |" % (
        r["engine"], r["pool_size"], r["load"], r["none_ms"]["p50"], r["none_ms"]["p95"],
        r["restricted_ms"]["p50"], r["restricted_ms"]["p95"], r["extra_p50_ms"]), file=sys.stderr)
' >"$OUT/egress-engines-$stamp.json"
log "results: $OUT/egress-engines-$stamp.json"
