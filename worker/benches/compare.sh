#!/usr/bin/env bash
# worker/benches/compare.sh - what the cynode-worker HTTP API costs on top of its sandboxes.
#
# Usage:  bash worker/benches/compare.sh          (as root, from anywhere in the repository)
#
# Builds the release worker, makes sure the host tools and the offline test image exist
# (through the project's own deploy scripts), starts real workers on 127.0.0.1 with
# temporary state directories under /var/tmp, and measures in one run:
#
#   1. podman: the round trip of a trivial job (command ["true"], sync
#      POST /v1/worker/jobs:run) against a bare `podman run` of the same command on the
#      same image with the flags the worker passes (worker/src/backend/engine.rs run_args).
#      The bare run is timed with `hyperfine -N --warmup 3 --runs 30`; the HTTP round trip
#      with a Python client that times every request itself (keep-alive connection, a
#      fresh job_id per request: job ids are idempotency keys). A second, interleaved
#      measurement (bare run and HTTP job alternating, in one process) cancels load drift.
#      Target: worker round trip <= 1.15 x bare podman run.
#   2. bwrap: p50/p95 of the same trivial job over >= 200 sequential requests, next to a
#      bare bwrap of the worker's argv (hyperfine). Target: p50 < 25 ms.
#   3. throughput: jobs/s, p95 latency and failures with 4 concurrent clients, for podman
#      and bwrap, each with queue.max_running 2 (the default) and 4.
#   4. every engine side by side: worker/benches/engines.sh with this build (bwrap, Podman,
#      Docker, Podman+runsc, Docker+runsc cold, Podman and Docker warm): bare start and
#      worker p50/p95, their ratio, the warm pools' claim-to-start, and throughput with
#      $THR_CLIENTS clients. ENGINES, RUNS (20) and THR_JOBS (40) pass through; SKIP_ENGINES=1
#      leaves this stage out.
#   Plus: GET /healthz round trips (the client's and HTTP's own cost), and a per-job time
#   breakdown joined from the client's clock, the response's started_at/ended_at and the
#   worker's JSON log lines "job started" / "job finished" (same host clock).
#
# Results (JSON) go to $OUT/run-<UTC stamp>/ and $OUT/latest.json (summary); the worker
# logs are kept beside them. Every worker is stopped on exit, and the state is removed.
#
# Environment (defaults in brackets):
#   CARGO_TARGET_DIR        [/var/cache/cynode/target]
#   OUT                     [/var/cache/cynode/bench/worker]
#   PODMAN_RUNS             [30]   bare and HTTP podman runs (after 3 warm-up runs each)
#   PAIRED_RUNS             [20]   interleaved podman pairs
#   BWRAP_RUNS              [300]  sequential bwrap requests (after 10 warm-up ones)
#   THR_BWRAP_JOBS          [200]  jobs per bwrap throughput run
#   THR_PODMAN_JOBS         [60]   jobs per podman throughput run
#   THR_CLIENTS             [4]    concurrent clients in throughput runs
#   MAX_LOAD                [1.0]  wait (at most QUIET_WAIT seconds) for the 1-minute load
#   QUIET_WAIT              [180]  average to drop below MAX_LOAD before measuring
# Needs: root, Debian 12; python3 (standard library only), hyperfine, jq.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}
[[ ${1:-} == -h || ${1:-} == --help ]] && usage 0
(($# == 0)) || usage 2

log() { printf 'compare: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

cd "$(dirname "$0")/../.."
repo=$PWD
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cynode/target}
OUT=${OUT:-/var/cache/cynode/bench/worker}
PODMAN_RUNS=${PODMAN_RUNS:-30}
PAIRED_RUNS=${PAIRED_RUNS:-20}
BWRAP_RUNS=${BWRAP_RUNS:-300}
THR_BWRAP_JOBS=${THR_BWRAP_JOBS:-200}
THR_PODMAN_JOBS=${THR_PODMAN_JOBS:-60}
THR_CLIENTS=${THR_CLIENTS:-4}
MAX_LOAD=${MAX_LOAD:-1.0}
QUIET_WAIT=${QUIET_WAIT:-180}
image=localhost/cynode-sba-test:latest

[[ $(id -u) -eq 0 ]] || die "must run as root (podman's root store, uid 1000 directories)"
for t in python3 jq; do command -v "$t" >/dev/null || die "$t not found"; done

# --- build and environment ------------------------------------------------------------------
log "building the release worker"
cargo build --release -p cynode-worker >&2
worker_bin=$CARGO_TARGET_DIR/release/cynode-worker
[[ -x $worker_bin ]] || die "no worker binary at $worker_bin"

log "host tools, static runner, test image, bwrap root filesystem"
CYNODE_SKIP_SMOKE=1 bash deploy/install-deps.sh >&2
bin=$(bash deploy/sba/build-static.sh)
bash deploy/sba/build-test-image.sh "$bin" >/dev/null
rootfs=$(bash deploy/sba/export-rootfs.sh "$image")
command -v hyperfine >/dev/null || die "hyperfine not found (deploy/install-deps.sh installs it)"

stamp=$(date -u +%Y%m%dT%H%M%SZ)
res=$OUT/run-$stamp
mkdir -p "$res"
# Sandboxes run as uid 1000 and must traverse to the state directories: /var/tmp, 0755.
work=$(mktemp -d /var/tmp/cynode-worker-bench.XXXXXX)
chmod 0755 "$work"
token=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')

pids=()
cleanup() {
  local rc=$? p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  for d in "$work"/*/; do
    [[ -f $d/worker.log ]] && cp "$d/worker.log" "$res/$(basename "$d").worker.log"
  done
  # The workers' disk volumes (loop-mounted ext4 on the retained jobs' directories and the
  # workspaces) outlive a stopped worker: unmount them before the state goes.
  { grep -F " $work/" /proc/self/mountinfo || true; } | awk '{print $5}' | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

loadavg() { cut -d' ' -f1-3 /proc/loadavg; }

wait_quiet() {
  local until=$((SECONDS + QUIET_WAIT)) l
  while :; do
    l=$(cut -d' ' -f1 /proc/loadavg)
    awk -v l="$l" -v m="$MAX_LOAD" 'BEGIN {exit !(l < m)}' && return 0
    if ((SECONDS >= until)); then
      log "load average still $l (>= $MAX_LOAD) after ${QUIET_WAIT}s; measuring anyway"
      return 0
    fi
    sleep 5
  done
}

# start_worker NAME BACKEND MAX_RUNNING: starts a worker; sets ADDR and appends to pids.
start_worker() {
  local name=$1 backend=$2 maxr=$3 d=$work/$1 line
  mkdir -p "$d"
  chmod 0755 "$d"
  printf '%s\n' "$token" >"$d/token"
  chmod 0600 "$d/token"
  cat >"$d/worker.yaml" <<EOF
listen: 127.0.0.1:0
backend: $backend
state_dir: $d/state
token_file: $d/token
bwrap:
  rootfs:
    "$image": $rootfs
queue:
  max_running: $maxr
EOF
  "$worker_bin" serve --config "$d/worker.yaml" >/dev/null 2>"$d/worker.log" &
  pids+=($!)
  ADDR=""
  for _ in $(seq 600); do
    line=$(grep -m1 '"cynode-worker listening"' "$d/worker.log" 2>/dev/null || true)
    [[ -n $line ]] && break
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  [[ -n $line ]] || {
    cat "$d/worker.log" >&2
    die "worker $name did not start"
  }
  [[ $(jq -r .fields.ready <<<"$line") == true ]] || {
    cat "$d/worker.log" >&2
    die "worker $name is not ready: $(jq -r .fields.detail <<<"$line")"
  }
  ADDR=$(jq -r .fields.addr <<<"$line")
  log "worker $name ($backend, max_running $maxr) on $ADDR"
}

# --- the measuring client (Python, standard library only) -----------------------------------
client=$work/client.py
cat >"$client" <<'PY'
"""Times Worker API requests one by one, in-process (no per-request interpreter start)."""
import argparse, datetime, http.client, json, math, statistics, subprocess, sys, threading, time
from concurrent.futures import ThreadPoolExecutor


def summary(secs):
    xs = sorted(x * 1000 for x in secs)
    if not xs:
        return {"n": 0}
    pct = lambda p: xs[max(0, math.ceil(p / 100 * len(xs)) - 1)]
    r = {"n": len(xs), "min_ms": xs[0], "p50_ms": pct(50), "p95_ms": pct(95),
         "p99_ms": pct(99), "max_ms": xs[-1], "mean_ms": statistics.fmean(xs),
         "stdev_ms": statistics.stdev(xs) if len(xs) > 1 else 0.0}
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}


class Conn:
    """One keep-alive HTTP/1.1 connection; reconnects (and counts it) if the server closed it."""

    def __init__(self, addr, token):
        host, port = addr.rsplit(":", 1)
        self.host, self.port, self.c, self.reconnects = host, int(port), None, 0
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def call(self, method, path, body=None):
        for attempt in (0, 1):
            if self.c is None:
                self.c = http.client.HTTPConnection(self.host, self.port, timeout=300)
            try:
                self.c.request(method, path, body=body, headers=self.headers)
                r = self.c.getresponse()
                return r.status, r.read()
            except (http.client.HTTPException, OSError):
                self.c.close()
                self.c = None
                self.reconnects += 1
                if attempt:
                    raise


def run_job(conn, image, task, job_id):
    """One trivial job; a retry after a dropped connection is safe: job ids are idempotent."""
    body = json.dumps({"version": 1, "task_id": task, "job_id": job_id,
                       "sandbox": {"image": image, "command": ["true"]}}).encode()
    wall0, t0 = time.time(), time.perf_counter()
    try:
        status, data = conn.call("POST", "/v1/worker/jobs:run", body)
    except Exception as e:  # noqa: BLE001 - a failed request is a data point
        status, data = -1, str(e).encode()
    dt = time.perf_counter() - t0
    rec = {"job_id": job_id, "t0": wall0, "t1": wall0 + dt, "latency_s": dt, "http": status, "ok": False}
    if status == 200:
        try:
            v = json.loads(data)
            rec.update(status=v.get("status"), exit_code=v.get("exit_code"),
                       started_at=v.get("started_at"), ended_at=v.get("ended_at"))
            rec["ok"] = v.get("status") == "completed" and v.get("exit_code") == 0
        except ValueError:
            pass
    if not rec["ok"]:
        rec["body"] = data[:400].decode(errors="replace")
    return rec


def result(recs, extra=None):
    ok = [r for r in recs if r["ok"]]
    out = {"requests": len(recs), "ok": len(ok), "failures": len(recs) - len(ok),
           "latency": summary([r["latency_s"] for r in recs]),
           "latency_ok": summary([r["latency_s"] for r in ok])}
    bad = [r for r in recs if not r["ok"]][:3]
    if bad:
        out["failure_examples"] = bad
    out.update(extra or {})
    return out


def cmd_seq(a):
    conn = Conn(a.addr, a.token)
    for i in range(a.warmup):
        run_job(conn, a.image, a.task, f"{a.prefix}-w{i}")
    recs = [run_job(conn, a.image, a.task, f"{a.prefix}-{i}") for i in range(a.n)]
    json.dump(recs, open(a.records, "w"))
    return result(recs, {"warmup": a.warmup, "reconnects": conn.reconnects})


def cmd_healthz(a):
    conn = Conn(a.addr, a.token)
    lat = []
    for i in range(a.warmup + a.n):
        t0 = time.perf_counter()
        status, _ = conn.call("GET", "/healthz")
        if i >= a.warmup:
            lat.append(time.perf_counter() - t0)
        assert status == 200, status
    return {"requests": a.n, "latency": summary(lat)}


def cmd_conc(a):
    local = threading.local()

    def one(i, prefix):
        if not hasattr(local, "conn"):
            local.conn = Conn(a.addr, a.token)
        return run_job(local.conn, a.image, f"{a.task}-{i % a.clients}", f"{prefix}-{i}")

    with ThreadPoolExecutor(a.clients) as ex:
        list(ex.map(lambda i: one(i, f"{a.prefix}-w"), range(a.clients)))  # warm connections
        t0 = time.perf_counter()
        recs = list(ex.map(lambda i: one(i, a.prefix), range(a.n)))
        wall = time.perf_counter() - t0
    json.dump(recs, open(a.records, "w"))
    ok = sum(r["ok"] for r in recs)
    return result(recs, {"clients": a.clients, "wall_s": round(wall, 3),
                         "jobs_per_s": round(ok / wall, 3)})


def cmd_paired(a):
    """Bare engine run and HTTP job alternating (order flipped each pair)."""
    argv = json.load(open(a.bare_argv))
    conn = Conn(a.addr, a.token)
    bare, http_, recs, bare_fail = [], [], [], 0

    def bare_run():
        t0 = time.perf_counter()
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
        return time.perf_counter() - t0, p.returncode

    for i in range(a.warmup + a.n):
        pair = {}
        for which in (("bare", "http") if i % 2 == 0 else ("http", "bare")):
            if which == "bare":
                pair["bare"] = bare_run()
            else:
                pair["http"] = run_job(conn, a.image, a.task, f"{a.prefix}-{i}")
        if i < a.warmup:
            continue
        bare.append(pair["bare"][0])
        bare_fail += pair["bare"][1] != 0
        http_.append(pair["http"]["latency_s"])
        recs.append(pair["http"])
    b, h = summary(bare), summary(http_)
    return {"pairs": a.n, "bare": b, "bare_failures": bare_fail, "http": h,
            "http_failures": sum(not r["ok"] for r in recs),
            "ratio_p50": round(h["p50_ms"] / b["p50_ms"], 3),
            "ratio_mean": round(h["mean_ms"] / b["mean_ms"], 3),
            "ratio_of_pair_medians": round(statistics.median(
                x / y for x, y in zip(http_, bare)), 3)}


def ts(s):
    s = s.replace("Z", "+00:00")
    main, _, rest = s.partition(".")
    if rest:
        i = next((k for k, ch in enumerate(rest) if not ch.isdigit()), len(rest))
        s = f"{main}.{(rest[:i] + '000000')[:6]}{rest[i:]}"
    return datetime.datetime.fromisoformat(s).timestamp()


def cmd_breakdown(a):
    """Where a job's time goes, from the client's clock, the response and the worker log."""
    ev = {}
    for line in open(a.log):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        f = v.get("fields", {})
        if f.get("message") in ("job started", "job finished") and "job_id" in f:
            ev.setdefault(f["job_id"], {})[f["message"]] = ts(v["timestamp"])
    parts = {"accept_to_start": [], "sandbox": [], "after_sandbox": [], "respond": [],
             "worker_total": [], "client_total": []}
    for r in json.load(open(a.records)):
        e = ev.get(r["job_id"], {})
        if not r["ok"] or "job started" not in e or "job finished" not in e:
            continue
        run = ts(r["ended_at"]) - ts(r["started_at"])  # millisecond resolution
        parts["accept_to_start"].append(e["job started"] - r["t0"])
        parts["sandbox"].append(run)
        parts["after_sandbox"].append(e["job finished"] - e["job started"] - run)
        parts["respond"].append(r["t1"] - e["job finished"])
        parts["worker_total"].append(e["job finished"] - e["job started"])
        parts["client_total"].append(r["latency_s"])
    return {k: {m: s[m] for m in ("n", "p50_ms", "mean_ms", "p95_ms") if m in s}
            for k, s in ((k, summary(v)) for k, v in parts.items())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["seq", "healthz", "conc", "paired", "breakdown"])
    for flag, default in (("--addr", None), ("--token", None), ("--image", None),
                          ("--task", "bench"), ("--prefix", "j"), ("--records", None),
                          ("--bare-argv", None), ("--log", None)):
        p.add_argument(flag, default=default)
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--clients", type=int, default=4)
    a = p.parse_args()
    out = globals()["cmd_" + a.mode](a)
    json.dump(out, sys.stdout, indent=2)
    print()


main()
PY
py() { python3 "$client" "$@" --token "$token" --image "$image"; }

# --- environment record ---------------------------------------------------------------------
jq -n --arg stamp "$stamp" --arg cpu "$(lscpu | sed -n 's/^Model name: *//p' | head -1)" \
  --arg nproc "$(nproc)" --arg mem "$(free -m | awk '/^Mem:/ {print $2}')" \
  --arg kernel "$(uname -r)" --arg podman "$(podman --version)" \
  --arg runc "$(runc --version | head -1)" --arg bwrap "$(bwrap --version)" \
  --arg hyperfine "$(hyperfine --version)" --arg python "$(python3 --version)" \
  --arg rev "$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  --arg dirty "$(git -C "$repo" status --porcelain 2>/dev/null | wc -l)" \
  --arg load "$(loadavg)" \
  '{stamp: $stamp, cpu: $cpu, nproc: ($nproc | tonumber), mem_mb: ($mem | tonumber),
    kernel: $kernel, podman: $podman, runc: $runc, bwrap: $bwrap, hyperfine: $hyperfine,
    python: $python, git_rev: $rev, git_dirty_files: ($dirty | tonumber),
    loadavg_at_start: $load}' >"$res/env.json"

start_worker podman podman 2
podman_addr=$ADDR
start_worker bwrap bwrap 2
bwrap_addr=$ADDR
start_worker bwrap4 bwrap 4
bwrap4_addr=$ADDR
start_worker podman4 podman 4
podman4_addr=$ADDR

# The bare runs use the worker's exact argv for a command job ["true"] (engine.rs run_args,
# bwrap.rs args, executor.rs sandbox_spec with the default limits); only --name is left out
# (podman picks a fresh one) so repeated runs do not collide.
bare=$work/bare
mkdir -p "$bare/job" "$bare/workspace"
chown 1000:1000 "$bare/job" "$bare/workspace"
chmod 0755 "$bare" "$bare/job" "$bare/workspace"
path_env=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
podman_argv=(podman run --rm --label io.cynode.node=bench --label cynodeai.task_id=bench
  --label cynodeai.job_id=bare --runtime runc --pull=never --network=none --read-only
  --user=1000:1000 --cap-drop=ALL --security-opt=no-new-privileges
  --ulimit=nofile=1024:1024 --ulimit=nproc=4096:4096 --memory=512m --memory-swap=512m
  --pids-limit=256 --cpus=1 --tmpfs=/tmp:rw,size=64m,mode=1777
  "--volume=$bare/job:/job:rw" "--volume=$bare/workspace:/workspace:rw" --workdir=/workspace
  --env=CYNODE_TASK_ID=bench --env=CYNODE_JOB_ID=bare --env=CYNODE_WORKSPACE_DIR=/workspace
  --env=CYNODE_ARTIFACTS_DIR=/job/artifacts "--env=PATH=$path_env" --entrypoint=true "$image")
# The worker also drops to uid 1000 before exec and puts bwrap in a fresh cgroup; setpriv
# does the first part here, the cgroup is the worker's own overhead.
bwrap_argv=(setpriv --reuid=1000 --regid=1000 --clear-groups bwrap --unshare-all
  --unshare-user --die-with-parent --new-session --uid 1000 --gid 1000 --hostname sandbox
  --cap-drop ALL --ro-bind "$rootfs" / --dev /dev --proc /proc --size 67108864 --tmpfs /tmp
  --bind "$bare/job" /job --bind "$bare/workspace" /workspace --chdir /workspace --clearenv
  --setenv CYNODE_TASK_ID bench --setenv CYNODE_JOB_ID bare --setenv CYNODE_WORKSPACE_DIR
  /workspace --setenv CYNODE_ARTIFACTS_DIR /job/artifacts --setenv PATH "$path_env" -- true)
"${podman_argv[@]}" || die "bare podman run fails: ${podman_argv[*]}"
"${bwrap_argv[@]}" || die "bare bwrap fails: ${bwrap_argv[*]}"
json_argv() { python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@"; }
json_argv "${podman_argv[@]}" >"$res/podman-bare-argv.json"
json_argv "${bwrap_argv[@]}" >"$res/bwrap-bare-argv.json"

wait_quiet
declare -A load
load[start]=$(loadavg)

# --- 1. podman: bare run vs HTTP round trip ------------------------------------------------------
log "1. podman: hyperfine bare run ($PODMAN_RUNS runs)"
hyperfine -N --warmup 3 --runs "$PODMAN_RUNS" --style basic \
  --command-name podman-run-bare --export-json "$res/podman-bare.hyperfine.json" \
  "${podman_argv[*]}" >&2
log "1. podman: worker round trips ($PODMAN_RUNS requests)"
py seq --addr "$podman_addr" --n "$PODMAN_RUNS" --warmup 3 --prefix podman-seq \
  --records "$res/podman-seq.records.json" >"$res/podman-seq.json"
log "1. podman: interleaved bare/HTTP pairs ($PAIRED_RUNS)"
py paired --addr "$podman_addr" --n "$PAIRED_RUNS" --warmup 2 --prefix podman-pair \
  --bare-argv "$res/podman-bare-argv.json" >"$res/podman-paired.json"
load[podman]=$(loadavg)

# --- 2. bwrap: sequential latency -----------------------------------------------------------
log "2. bwrap: hyperfine bare bwrap"
hyperfine -N --warmup 5 --runs 100 --style basic --command-name bwrap-bare \
  --export-json "$res/bwrap-bare.hyperfine.json" "${bwrap_argv[*]}" >&2
log "2. bwrap: healthz round trips"
py healthz --addr "$bwrap_addr" --n 500 --warmup 20 >"$res/healthz.json"
log "2. bwrap: $BWRAP_RUNS sequential trivial jobs"
py seq --addr "$bwrap_addr" --n "$BWRAP_RUNS" --warmup 10 --prefix bwrap-seq \
  --records "$res/bwrap-seq.records.json" >"$res/bwrap-seq.json"
load[bwrap]=$(loadavg)

# --- 3. throughput ----------------------------------------------------------------------------
for spec in "bwrap 2 $bwrap_addr $THR_BWRAP_JOBS" "bwrap 4 $bwrap4_addr $THR_BWRAP_JOBS" \
  "podman 2 $podman_addr $THR_PODMAN_JOBS" "podman 4 $podman4_addr $THR_PODMAN_JOBS"; do
  read -r be mr addr n <<<"$spec"
  log "3. throughput: $be, max_running $mr, $n jobs, $THR_CLIENTS clients"
  py conc --addr "$addr" --n "$n" --clients "$THR_CLIENTS" --prefix "thr-$be-$mr" \
    --task "thr-$be-$mr" --records "$res/thr-$be-max$mr.records.json" \
    >"$res/thr-$be-max$mr.json"
done
load[end]=$(loadavg)

# --- 4. every engine side by side -------------------------------------------------------------
if [[ -z ${SKIP_ENGINES:-} ]]; then
  log "4. every engine: worker/benches/engines.sh"
  RESULT=$res/engines.json WORKER_BIN=$worker_bin THR_CLIENTS=$THR_CLIENTS \
    bash "$repo/worker/benches/engines.sh" >&2
else
  echo null >"$res/engines.json"
fi

# --- where the time goes ------------------------------------------------------------------
python3 "$client" breakdown --records "$res/podman-seq.records.json" \
  --log "$work/podman/worker.log" >"$res/podman-breakdown.json"
python3 "$client" breakdown --records "$res/bwrap-seq.records.json" \
  --log "$work/bwrap/worker.log" >"$res/bwrap-breakdown.json"

# --- summary --------------------------------------------------------------------------------
cd "$res"
jq -n --slurpfile env env.json --slurpfile pb podman-bare.hyperfine.json \
  --slurpfile ps podman-seq.json --slurpfile pp podman-paired.json \
  --slurpfile bb bwrap-bare.hyperfine.json --slurpfile bs bwrap-seq.json \
  --slurpfile hz healthz.json --slurpfile pbd podman-breakdown.json \
  --slurpfile bbd bwrap-breakdown.json --slurpfile eng engines.json \
  --slurpfile t1 thr-bwrap-max2.json --slurpfile t2 thr-bwrap-max4.json \
  --slurpfile t3 thr-podman-max2.json --slurpfile t4 thr-podman-max4.json \
  --arg l0 "${load[start]}" --arg l1 "${load[podman]}" --arg l2 "${load[bwrap]}" \
  --arg l3 "${load[end]}" '
  def ms: . * 1000 | . * 1000 | round / 1000;
  def hf: .results[0] | {mean_ms: (.mean | ms), median_ms: (.median | ms),
    stddev_ms: (.stddev | ms), min_ms: (.min | ms), max_ms: (.max | ms),
    runs: (.times | length)};
  def thr: {jobs: .requests, ok, failures, clients, wall_s, jobs_per_s,
    p50_ms: .latency.p50_ms, p95_ms: .latency.p95_ms};
  ($pb[0] | hf) as $bare | $ps[0] as $seq | ($bb[0] | hf) as $bbare | $bs[0] as $bseq |
  {env: ($env[0] + {loadavg: {start: $l0, after_podman: $l1, after_bwrap: $l2, end: $l3}}),
   podman: {
     bare_hyperfine: $bare,
     worker_http: ($seq.latency + {failures: $seq.failures}),
     ratio_mean: ($seq.latency.mean_ms / $bare.mean_ms * 1000 | round / 1000),
     ratio_median: ($seq.latency.p50_ms / $bare.median_ms * 1000 | round / 1000),
     paired: $pp[0],
     target: "worker round trip <= 1.15 x bare podman run",
     target_met_mean: ($seq.latency.mean_ms / $bare.mean_ms <= 1.15),
     target_met_median: ($seq.latency.p50_ms / $bare.median_ms <= 1.15),
     breakdown: $pbd[0]},
   bwrap: {
     bare_hyperfine: $bbare,
     worker_http: ($bseq.latency + {failures: $bseq.failures}),
     target: "p50 < 25 ms",
     target_met: ($bseq.latency.p50_ms < 25),
     breakdown: $bbd[0]},
   healthz: $hz[0].latency,
   throughput: {bwrap_max_running_2: ($t1[0] | thr), bwrap_max_running_4: ($t2[0] | thr),
                podman_max_running_2: ($t3[0] | thr), podman_max_running_4: ($t4[0] | thr)},
   engines: $eng[0]}
  ' >summary.json
cp summary.json "$OUT/latest.json"
log "results in $res (summary: $OUT/latest.json)"
jq . summary.json
