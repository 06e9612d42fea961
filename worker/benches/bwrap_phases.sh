#!/usr/bin/env bash
# worker/benches/bwrap_phases.sh - where a trivial bwrap job's time goes in the worker.
#
# Usage:  bash worker/benches/bwrap_phases.sh      (as root, from anywhere in the repository)
#
# Starts one release worker (backend bwrap, queue.max_running 2, CYNODE_LOG_LEVEL=debug)
# on 127.0.0.1 with a temporary state directory under /var/tmp, and times RUNS trivial
# jobs (command ["true"], sync POST /v1/worker/jobs:run, keep-alive connection, a fresh
# job_id each) interleaved with a bare bwrap of the worker's argv (the same argv as
# compare.sh: setpriv to uid 1000, no cgroup, no seccomp), order flipped every pair so
# load drift hits both alike. Then it reads the worker's debug lines "phases: …" (every
# field ending in _us is one phase of one job, timed by executor::Lap) and prints a table
# phase -> p50/p95 ms, next to the client's p50/p95 of both, their ratio and the load
# average before and after. Does not build: run `cargo build --release -p cynode-worker`
# first (CARGO_TARGET_DIR as below). Needs the test image's rootfs
# (deploy/sba/export-rootfs.sh) already exported.
#
# Environment (defaults in brackets):
#   CARGO_TARGET_DIR   [/var/cache/cynode/target-dev]
#   RUNS               [200]   pairs measured (after 20 warm-up pairs)
#   OUT                [/var/cache/cynode/bench/worker]  results: bwrap-phases-<stamp>.json
#   WORKER_ENV         []      extra environment for the worker, e.g. CYNODE_DISK_VOLUMES=off
#   WORKER_BIN         [$CARGO_TARGET_DIR/release/cynode-worker]
#   WARM_SLOTS         [0]     bwrap.warm_slots (warm sandboxes, backend/bwrap/warm.rs; the
#                              waiter from deploy/worker/build-waiter.sh must be built)
set -euo pipefail

cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cynode/target-dev}
RUNS=${RUNS:-200}
OUT=${OUT:-/var/cache/cynode/bench/worker}
image=localhost/cynode-sba-test:latest
log() { printf 'bwrap_phases: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}
[[ $(id -u) -eq 0 ]] || die "must run as root"
worker_bin=${WORKER_BIN:-$CARGO_TARGET_DIR/release/cynode-worker}
[[ -x $worker_bin ]] || die "no release worker at $worker_bin"
rootfs=$(bash deploy/sba/export-rootfs.sh "$image")
mkdir -p "$OUT"

work=$(mktemp -d /var/tmp/cynode-phases.XXXXXX)
chmod 0755 "$work"
pid=""
cleanup() {
  local rc=$?
  if [[ -n $pid ]]; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  # A worker killed before its clean-up leaves volumes mounted in its state directory.
  if [[ -d $work/state ]]; then
    { grep -F " $work/" /proc/self/mountinfo || true; } | awk '{print $5}' | sort -r |
      while read -r m; do umount -l "$m" 2>/dev/null || true; done
  fi
  [[ -n ${KEEP_LOG:-} ]] && cp "$work/worker.log" "$KEEP_LOG"
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

token=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
printf '%s\n' "$token" >"$work/token"
chmod 0600 "$work/token"
cat >"$work/worker.yaml" <<EOF
listen: 127.0.0.1:0
backend: bwrap
state_dir: $work/state
token_file: $work/token
bwrap:
  warm_slots: ${WARM_SLOTS:-0}
  rootfs:
    "$image": $rootfs
queue:
  max_running: 2
EOF
# shellcheck disable=SC2086 # WORKER_ENV is a list of NAME=value words
env CYNODE_LOG_LEVEL=debug ${WORKER_ENV:-} "$worker_bin" serve --config "$work/worker.yaml" \
  >/dev/null 2>"$work/worker.log" &
pid=$!
line=""
for _ in $(seq 600); do
  line=$(grep -m1 '"cynode-worker listening"' "$work/worker.log" 2>/dev/null || true)
  [[ -n $line ]] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
[[ -n $line ]] || {
  cat "$work/worker.log" >&2
  die "the worker did not start"
}
addr=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["fields"]["addr"])' "$line")
log "worker on $addr"

# The worker's argv for a trivial job (bwrap.rs args, default limits), as compare.sh has it.
bare=(setpriv --reuid=1000 --regid=1000 --clear-groups bwrap --unshare-all
  --unshare-user --die-with-parent --new-session --uid 1000 --gid 1000 --hostname sandbox
  --cap-drop ALL --ro-bind "$rootfs" / --dev /dev --proc /proc --size 67108864 --tmpfs /tmp
  --chdir / --clearenv -- true)
"${bare[@]}" || die "bare bwrap fails: ${bare[*]}"

load0=$(cut -d' ' -f1-3 /proc/loadavg)
stamp=$(date -u +%Y%m%dT%H%M%SZ)
python3 - "$addr" "$token" "$image" "$RUNS" "$work/worker.log" "$load0" \
  "$OUT/bwrap-phases-$stamp.json" "${bare[@]}" <<'PY'
import http.client, json, math, subprocess, sys, time
addr, token, image, runs, logf, load0, out = sys.argv[1:8]
bare = sys.argv[8:]
runs = int(runs)
host, port = addr.rsplit(":", 1)
c = http.client.HTTPConnection(host, int(port), timeout=120)
hdr = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

def job(i):
    body = json.dumps({"version": 1, "task_id": "phases", "job_id": f"ph-{i}",
                       "sandbox": {"image": image, "command": ["true"]}})
    t0 = time.perf_counter()
    c.request("POST", "/v1/worker/jobs:run", body=body, headers=hdr)
    r = c.getresponse()
    data = r.read()
    dt = time.perf_counter() - t0
    v = json.loads(data) if r.status == 200 else {}
    ok = v.get("status") == "completed" and v.get("exit_code") == 0
    if not ok:
        print("failed job:", r.status, data[:300], file=sys.stderr)
    return dt, ok, f"ph-{i}"

def bare_run():
    t0 = time.perf_counter()
    p = subprocess.run(bare, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0, p.returncode == 0

warm = 20
w, b, ids, fails = [], [], [], 0
for i in range(warm + runs):
    order = ("b", "w") if i % 2 == 0 else ("w", "b")
    for which in order:
        if which == "b":
            dt, ok = bare_run()
            if i >= warm:
                b.append(dt)
        else:
            dt, ok, jid = job(i)
            if i >= warm:
                w.append(dt)
                ids.append(jid)
        fails += not ok

def pct(xs, p):
    xs = sorted(xs)
    return xs[max(0, math.ceil(p / 100 * len(xs)) - 1)] if xs else float("nan")

time.sleep(0.5)  # the last job's "finish" line is written before its response; margin
keep = set(ids)
phases = {}
warm_jobs = 0
for line in open(logf):
    try:
        v = json.loads(line)
    except ValueError:
        continue
    f = v.get("fields", {})
    msg = f.get("message", "")
    if not msg.startswith("phases:"):
        continue
    jid = f.get("job_id") or (f.get("sandbox") or "").removeprefix("cynode-")
    if jid not in keep:
        continue
    warm_jobs += f.get("warm_slot") is True
    for k, x in f.items():
        if k.endswith("_us"):
            phases.setdefault((msg.removeprefix("phases: "), k[:-3]), []).append(x / 1000)
load1 = open("/proc/loadavg").read().split()[:3]
res = {"runs": runs, "failures": fails, "load_before": load0, "load_after": " ".join(load1),
       "bare_p50_ms": pct(b, 50) * 1000, "bare_p95_ms": pct(b, 95) * 1000,
       "worker_p50_ms": pct(w, 50) * 1000, "worker_p95_ms": pct(w, 95) * 1000,
       "phases_p50_ms": {f"{g}.{k}": round(pct(xs, 50), 3) for (g, k), xs in phases.items()},
       "phases_p95_ms": {f"{g}.{k}": round(pct(xs, 95), 3) for (g, k), xs in phases.items()}}
res["ratio_p50"] = res["worker_p50_ms"] / res["bare_p50_ms"]
res["warm_sandbox_jobs"] = warm_jobs
json.dump(res, open(out, "w"), indent=1)
print(f"load {load0} -> {' '.join(load1)}; {runs} pairs, {fails} failures")
print(f"bare bwrap   p50 {res['bare_p50_ms']:7.2f} ms  p95 {res['bare_p95_ms']:7.2f} ms")
print(f"worker job   p50 {res['worker_p50_ms']:7.2f} ms  p95 {res['worker_p95_ms']:7.2f} ms"
      f"  ratio p50 {res['ratio_p50']:.2f}x; {warm_jobs} of {len(keep)} jobs in a warm sandbox")
print("| phase | p50 ms | p95 ms |")
print("|---|---|---|")
for (g, k), xs in phases.items():
    print(f"| {g}: {k} | {pct(xs, 50):.3f} | {pct(xs, 95):.3f} |")
print(f"(results: {out})")
PY
