#!/usr/bin/env bash
# worker/benches/microvm.sh - what a job costs on the microvm backend.
#
# Usage:  bash worker/benches/microvm.sh          (as root, from anywhere in the repository)
#
# Builds the release worker, prepares the guest kernel, init and test image through the
# project's deploy scripts, starts real workers (backend: microvm) on 127.0.0.1 with
# temporary state under /var/tmp, and measures:
#   1. cold boot-to-job: pool_size 0, COLD_RUNS sequential trivial jobs (command ["true"]);
#      per job the worker's "microvm job ended" log line gives to_job_ms (claim started to
#      the guest's `started` message, i.e. QEMU start, guest boot, mounts, exec) and
#      boot_ms (QEMU start to the guest's ready message). Target: p50 <= 150 ms.
#   2. warm claim: pool_size 2, WARM_RUNS sequential jobs, each after the pool is full
#      again; to_job_ms is then the claim alone (bind mounts, spec, exec). Target p50
#      <= 30 ms. Also the client's round trip of the whole job.
#   3. idle VM memory: VmRSS and PSS of each idle QEMU in the pool (host memory the VM
#      costs while it waits). Target <= 32 MiB.
#   4. throughput: THR_JOBS jobs from THR_CLIENTS concurrent clients, pool_size 2:
#      jobs/s on this host's cores.
# Accelerator: ACCEL (kvm|tcg). Results (JSON) go to $OUT/latest.json; worker logs beside.
#
# Environment (defaults in brackets):
#   CARGO_TARGET_DIR [/var/cache/cynode/target]   OUT [/var/cache/cynode/bench/microvm]
#   ACCEL [kvm]  COLD_RUNS [10]  WARM_RUNS [20]  THR_JOBS [20]  THR_CLIENTS [4]
# Needs: root, /dev/kvm (for kvm), python3 (standard library only), jq.
set -euo pipefail
[[ ${1:-} == -h || ${1:-} == --help ]] && {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  exit 0
}
log() { printf 'microvm-bench: %s\n' "$*" >&2; }
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cynode/target}
OUT=${OUT:-/var/cache/cynode/bench/microvm}
ACCEL=${ACCEL:-kvm}
COLD_RUNS=${COLD_RUNS:-10}
WARM_RUNS=${WARM_RUNS:-20}
THR_JOBS=${THR_JOBS:-20}
THR_CLIENTS=${THR_CLIENTS:-4}

bash deploy/microvm/build-kernel.sh >/dev/null
bash deploy/microvm/build-init.sh >/dev/null
bin=$(bash deploy/sba/build-static.sh)
bash deploy/sba/build-test-image.sh "$bin" >/dev/null
image=localhost/cynode-sba-test:latest
rootfs=$(bash deploy/sba/export-rootfs.sh "$image")
cargo build --release -p cynode-worker >&2
worker=$CARGO_TARGET_DIR/release/cynode-worker

mkdir -p "$OUT"
work=$(mktemp -d /var/tmp/cynode-microvm-bench.XXXXXX)
chmod 0755 "$work"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
token=bench-token-0123456789abcdef0123
echo "$token" >"$work/token"

# start NAME POOL_SIZE: starts a worker, prints its address.
start() {
  local dir=$work/$1
  mkdir -p "$dir"
  chmod 0755 "$dir"
  cat >"$dir/worker.yaml" <<EOF
listen: 127.0.0.1:0
backend: microvm
state_dir: $dir/state
token_file: $work/token
queue:
  max_running: 4
bwrap:
  rootfs:
    "$image": $rootfs
microvm:
  accel: $ACCEL
  pool_size: $2
EOF
  "$worker" serve --config "$dir/worker.yaml" 2>"$dir/worker.log" &
  pids+=($!)
  local addr=""
  for _ in $(seq 1 300); do
    addr=$(grep -m1 '"cynode-worker listening"' "$dir/worker.log" 2>/dev/null | jq -r .fields.addr || true)
    [[ -n $addr ]] && break
    sleep 0.1
  done
  [[ -n $addr ]] || {
    cat "$dir/worker.log" >&2
    exit 1
  }
  echo "$addr"
}

cold=$(start cold 0)
warm=$(start warm 2)
log "workers: cold $cold, warm $warm ($ACCEL)"

python3 - "$cold" "$warm" "$token" "$work" "$COLD_RUNS" "$WARM_RUNS" "$THR_JOBS" "$THR_CLIENTS" "$ACCEL" >"$OUT/latest.json" <<'PY'
import json, os, statistics, sys, threading, time, http.client
cold, warm, token, work = sys.argv[1:5]
cold_runs, warm_runs, thr_jobs, thr_clients = map(int, sys.argv[5:9])
accel = sys.argv[9]
seq = [0]

def job(addr):
    seq[0] += 1
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps({"version": 1, "task_id": "bench", "job_id": f"b-{os.getpid()}-{seq[0]}-{threading.get_ident()}",
                       "sandbox": {"image": "localhost/cynode-sba-test:latest", "command": ["true"]}})
    t = time.monotonic()
    c.request("POST", "/v1/worker/jobs:run", body, {"authorization": f"Bearer {token}", "content-type": "application/json"})
    r = c.getresponse(); v = json.loads(r.read())
    return (time.monotonic() - t) * 1000, v.get("status")

def ended(name):
    out = []
    for line in open(f"{work}/{name}/worker.log"):
        try:
            f = json.loads(line)["fields"]
        except Exception:
            continue
        if f.get("message") == "microvm job ended":
            out.append(f)
    return out

def qemus(name):
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if cmd.startswith("qemu-system") and f"{work}/{name}/state" in cmd:
            pids.append(p)
    return pids

def wait_pool(name, n, bound=120):
    t = time.monotonic()
    while len(qemus(name)) < n and time.monotonic() - t < bound:
        time.sleep(0.05)
    # A VM counts once its guest said ready: the pool's log line.
    time.sleep(0.2)

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None

res = {"accel": accel}
rt = [job(cold) for _ in range(cold_runs)]
e = ended("cold")
res["cold"] = {"runs": cold_runs, "statuses": sorted({s for _, s in rt}),
               "to_job_ms_p50": pct([x["to_job_ms"] for x in e if x.get("to_job_ms") is not None], 50),
               "to_job_ms_p95": pct([x["to_job_ms"] for x in e if x.get("to_job_ms") is not None], 95),
               "boot_ms_p50": pct([x["boot_ms"] for x in e], 50),
               "round_trip_ms_p50": pct([r for r, _ in rt], 50)}
wait_pool("warm", 2)
rts = []
for _ in range(warm_runs):
    wait_pool("warm", 2)
    rts.append(job(warm))
e = [x for x in ended("warm") if x.get("warm")]
res["warm"] = {"runs": warm_runs, "warm_claims": len(e), "statuses": sorted({s for _, s in rts}),
               "claim_to_job_ms_p50": pct([x["to_job_ms"] for x in e if x.get("to_job_ms") is not None], 50),
               "claim_to_job_ms_p95": pct([x["to_job_ms"] for x in e if x.get("to_job_ms") is not None], 95),
               "round_trip_ms_p50": pct([r for r, _ in rts], 50)}
wait_pool("warm", 2)
mem = []
for p in qemus("warm"):
    st = dict(l.split(":", 1) for l in open(f"/proc/{p}/status") if ":" in l)
    pss = 0
    try:
        for l in open(f"/proc/{p}/smaps_rollup"):
            if l.startswith("Pss:"):
                pss = int(l.split()[1])
    except OSError:
        pass
    mem.append({"rss_kib": int(st["VmRSS"].split()[0]), "pss_kib": pss})
res["idle_vm_memory"] = mem
t = time.monotonic(); done = []
def client(n):
    for _ in range(n):
        done.append(job(warm))
th = [threading.Thread(target=client, args=(thr_jobs // thr_clients,)) for _ in range(thr_clients)]
[x.start() for x in th]; [x.join() for x in th]
el = time.monotonic() - t
res["throughput"] = {"jobs": len(done), "clients": thr_clients, "seconds": round(el, 2),
                     "jobs_per_s": round(len(done) / el, 2), "statuses": sorted({s for _, s in done}),
                     "round_trip_ms_p95": pct([r for r, _ in done], 95), "cpus": os.cpu_count()}
print(json.dumps(res, indent=2))
PY
cp "$work"/cold/worker.log "$OUT/cold-worker.log"
cp "$work"/warm/worker.log "$OUT/warm-worker.log"
cat "$OUT/latest.json"
