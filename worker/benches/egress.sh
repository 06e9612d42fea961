#!/usr/bin/env bash
# worker/benches/egress.sh - what the egress proxy costs a job.
#
# Usage:  bash worker/benches/egress.sh          (as root, from anywhere in the repository)
#
# Starts the release cynode-worker (bwrap backend) on 127.0.0.1 with an egress allowlist,
# an HTTP origin on 127.0.0.1 (python3 http.server over a 100 MiB file), and runs jobs
# whose image is the host's root filesystem (an overlay adding /job and /workspace, so
# curl and python3 are there). Measures:
#
#   1. download: 100 MiB with curl inside a `restricted` job, through the proxy (the
#      curl's own time_total), against the same curl run straight on the host.
#      Target: proxy throughput >= 0.8 x direct. DOWNLOAD_RUNS rounds, each of
#      DOWNLOAD_EACH direct downloads then one job of DOWNLOAD_EACH proxied ones; median
#      and best of all. Also the worker's own CPU time (user + system, all its threads)
#      per proxied download, taken around each job: what the proxy costs whatever the
#      machine's load (the job's set-up is in it too, shared by DOWNLOAD_EACH downloads).
#   2. CONNECT set-up: inside one job, python3 opens CONNECT_RUNS tunnels in a row
#      (connect to 127.0.0.1:3128, CONNECT, read the 200; then close and wait for the
#      tunnel's end, so tunnels do not pile up against the job's connection bound) and
#      reports p50/p95 of the set-up, next to a
#      plain TCP connect to the origin from the same sandbox... which has no route: so
#      next to a TCP connect to the proxy alone. Target: p50 < 2 ms. The host's
#      TcpExtListenOverflows/ListenDrops deltas over this step are recorded (a SYN the
#      origin's full accept queue drops costs the tunnel one second).
#   3. a trivial job (`true`) with network_policy restricted against none: p50 of the
#      client's round trip over JOB_RUNS sync requests each, interleaved.
#      Target: < 3 ms extra at p50.
#
# Results (JSON) go to $OUT/egress-<UTC stamp>.json and $OUT/egress-latest.json, with the
# 1-minute load average before and after. Everything started is stopped on exit.
#
# Environment (defaults in brackets):
#   CARGO_TARGET_DIR   [/var/cache/cynode/target]
#   OUT                [/var/cache/cynode/bench/worker]
#   DOWNLOAD_RUNS      [5]
#   DOWNLOAD_EACH      [5]
#   CONNECT_RUNS       [300]
#   JOB_RUNS           [40]
#   ORIGIN_BACKLOG     [1024] the origin's listen backlog (5 reproduces http.server's)
#   WORKER_BIN         [the release build]  a cynode-worker binary to measure instead
# Needs: root, bwrap, curl, python3 (standard library), mount with overlay.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}
[[ ${1:-} == -h || ${1:-} == --help ]] && usage 0
(($# == 0)) || usage 2

log() { printf 'egress-bench: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cynode/target}
OUT=${OUT:-/var/cache/cynode/bench/worker}
DOWNLOAD_RUNS=${DOWNLOAD_RUNS:-5}
DOWNLOAD_EACH=${DOWNLOAD_EACH:-5}
CONNECT_RUNS=${CONNECT_RUNS:-300}
JOB_RUNS=${JOB_RUNS:-40}
ORIGIN_BACKLOG=${ORIGIN_BACKLOG:-1024}
[[ $(id -u) -eq 0 ]] || die "must run as root"
for t in bwrap curl python3 mount; do command -v "$t" >/dev/null || die "$t not found"; done

if [[ -n ${WORKER_BIN:-} ]]; then
  worker_bin=$WORKER_BIN
else
  log "building the release worker"
  cargo build --release -q -p cynode-worker
  worker_bin=$CARGO_TARGET_DIR/release/cynode-worker
fi

work=$(mktemp -d /var/tmp/cynode-egress-bench.XXXXXX)
chmod 755 "$work"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  # The node's job and workspace volumes, and the overlay, are mounts under $work.
  findmnt -rn -o TARGET | grep "^$work/" | sort -r | xargs -r umount -l || true
  rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work/root/upper/job" "$work/root/upper/workspace" "$work/root/work" \
  "$work/root/merged" "$work/www"
chmod 755 "$work/root" "$work/root/upper" "$work/root/merged"
mount -t overlay overlay \
  -o "lowerdir=/,upperdir=$work/root/upper,workdir=$work/root/work" "$work/root/merged"
head -c $((100 * 1024 * 1024)) /dev/urandom >"$work/www/f"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
origin_port=$(free_port)
# The origin: http.server's threading server over $work/www, its listen backlog
# ORIGIN_BACKLOG (http.server's own default is 5: a burst of tunnels overflows it, and
# each dropped SYN costs the client TCP's one-second retransmission).
python3 - "$origin_port" "$work/www" "$ORIGIN_BACKLOG" >/dev/null 2>&1 <<'PY' &
import functools, http.server, sys
class Origin(http.server.ThreadingHTTPServer):
    request_queue_size = int(sys.argv[3])
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[2])
Origin(("127.0.0.1", int(sys.argv[1])), handler).serve_forever()
PY
pids+=($!)

token=bench-token-0123456789abcdef
printf '%s' "$token" >"$work/token"
image=localhost/cynode-host-root:latest
cat >"$work/worker.yaml" <<EOF
listen: 127.0.0.1:0
backend: bwrap
state_dir: $work/state
token_file: $work/token
bwrap:
  rootfs:
    "$image": $work/root/merged
limits:
  memory_mb: 1024
egress:
  allow: ["127.0.0.1:$origin_port"]
EOF
"$worker_bin" serve --config "$work/worker.yaml" 2>"$work/worker.log" &
pids+=($!)
worker_pid=$!
addr=
for _ in $(seq 200); do
  addr=$(grep -o '"addr":"[^"]*"' "$work/worker.log" 2>/dev/null | head -n1 | cut -d'"' -f4 || true)
  [[ -n $addr ]] && break
  sleep 0.05
done
[[ -n $addr ]] || die "the worker did not start: $(tail -n 5 "$work/worker.log")"
for _ in $(seq 200); do
  curl -fsS -o /dev/null "http://127.0.0.1:$origin_port/f" -r 0-0 && break
  sleep 0.05
done
load_before=$(cut -d' ' -f1 /proc/loadavg)
log "worker at $addr, origin at 127.0.0.1:$origin_port, load $load_before"

export ADDR=$addr TOKEN=$token IMAGE=$image ORIGIN_PORT=$origin_port WORKER_PID=$worker_pid \
  DOWNLOAD_RUNS DOWNLOAD_EACH CONNECT_RUNS JOB_RUNS ORIGIN_BACKLOG LOAD_BEFORE=$load_before
stamp=$(date -u +%Y%m%dT%H%M%SZ)
export STAMP=$stamp
mkdir -p "$OUT"
python3 - >"$OUT/egress-$stamp.json" <<'PY'
import json, os, statistics, subprocess, time, urllib.request

addr, token, image = os.environ["ADDR"], os.environ["TOKEN"], os.environ["IMAGE"]
port = os.environ["ORIGIN_PORT"]
n = 0

def job(script, policy):
    global n
    n += 1
    body = {"version": 1, "task_id": "bench", "job_id": f"eg-{os.getpid()}-{n}",
            "sandbox": {"image": image, "command": ["sh", "-c", script],
                        "network_policy": policy, "timeout_seconds": 600}}
    req = urllib.request.Request(f"http://{addr}/v1/worker/jobs:run",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        resp = json.load(r)
    return resp, (time.perf_counter() - t) * 1000

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]

url = f"http://127.0.0.1:{port}/f"
curl = f"curl -sS -o /dev/null -w '%{{time_total}}\\n' {url}"
# NO_PROXY names 127.0.0.1: the job's curl is told to use the proxy anyway.
via_proxy = curl.replace("curl ", "curl --noproxy '' -x $HTTP_PROXY ", 1)
def cpu_s(pid):
    # utime + stime of every thread of the process (fields 14 and 15 of /proc/PID/stat).
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

each = int(os.environ["DOWNLOAD_EACH"])
loop = f"for i in $(seq {each}); do " + "{}; done"
worker_pid = int(os.environ["WORKER_PID"])
direct, proxied, worker_cpu = [], [], 0.0
for _ in range(int(os.environ["DOWNLOAD_RUNS"])):
    out = subprocess.run(["sh", "-c", loop.format(curl)], capture_output=True, text=True,
                         check=True, env={"PATH": os.environ["PATH"]})
    direct += [float(x) for x in out.stdout.split()]
    before = cpu_s(worker_pid)
    resp, _ = job(loop.format(via_proxy), "restricted")
    worker_cpu += cpu_s(worker_pid) - before
    assert resp["status"] == "completed", resp
    proxied += [float(x) for x in resp["stdout"].split()]
    assert len(proxied) == len(direct), resp
mib = 100
dl = {
    "mib": mib,
    "direct_mib_s_median": mib / statistics.median(direct),
    "proxy_mib_s_median": mib / statistics.median(proxied),
    "worker_cpu_ms_per_proxied_download": worker_cpu * 1000 / len(proxied),
    "direct_s": direct, "proxy_s": proxied,
}
dl["ratio_median"] = dl["proxy_mib_s_median"] / dl["direct_mib_s_median"]
dl["ratio_best"] = min(direct) / min(proxied)

connect_py = f"""
import socket, time, json
c, t = [], []
for i in range({int(os.environ['CONNECT_RUNS'])}):
    a = time.perf_counter()
    s = socket.create_connection(('127.0.0.1', 3128))
    b = time.perf_counter()
    s.sendall(b'CONNECT 127.0.0.1:{port} HTTP/1.1\\r\\nHost: 127.0.0.1:{port}\\r\\n\\r\\n')
    buf = b''
    while b'\\r\\n\\r\\n' not in buf:
        buf += s.recv(4096)
    e = time.perf_counter()
    assert buf.startswith(b'HTTP/1.1 200'), buf
    s.shutdown(socket.SHUT_WR)
    while s.recv(4096):
        pass
    s.close()
    c.append((b - a) * 1000); t.append((e - a) * 1000)
print(json.dumps({{'tcp_ms': c, 'connect_ms': t}}))
"""
def listen_drops():
    rows = [l.split() for l in open("/proc/net/netstat") if l.startswith("TcpExt:")]
    v = dict(zip(rows[0][1:], map(int, rows[1][1:])))
    return {"overflows": v.get("ListenOverflows", 0), "drops": v.get("ListenDrops", 0)}

drops_before = listen_drops()
resp, _ = job(f"python3 -c \"{connect_py}\"", "restricted")
assert resp["status"] == "completed", resp
drops_after = listen_drops()
cm = json.loads(resp["stdout"])
conn = {"runs": len(cm["connect_ms"]),
        "connect_p50_ms": pct(cm["connect_ms"], 50), "connect_p95_ms": pct(cm["connect_ms"], 95),
        "tcp_to_proxy_p50_ms": pct(cm["tcp_ms"], 50),
        "over_1s": sum(1 for t in cm["connect_ms"] if t > 900),
        "origin_backlog": int(os.environ["ORIGIN_BACKLOG"]),
        "listen_overflows": drops_after["overflows"] - drops_before["overflows"],
        "listen_drops": drops_after["drops"] - drops_before["drops"]}

off, on = [], []
for _ in range(3):
    job("true", "none"); job("true", "restricted")
for _ in range(int(os.environ["JOB_RUNS"])):
    r, ms = job("true", "none"); assert r["status"] == "completed", r; off.append(ms)
    r, ms = job("true", "restricted"); assert r["status"] == "completed", r; on.append(ms)
trivial = {"runs": len(on), "off_p50_ms": pct(off, 50), "on_p50_ms": pct(on, 50),
           "off_p95_ms": pct(off, 95), "on_p95_ms": pct(on, 95)}
trivial["extra_p50_ms"] = trivial["on_p50_ms"] - trivial["off_p50_ms"]

print(json.dumps({"date": os.environ["STAMP"], "download": dl, "connect": conn, "trivial_job": trivial,
                  "load_before": float(os.environ["LOAD_BEFORE"]),
                  "load_after": float(open("/proc/loadavg").read().split()[0]),
                  "nproc": os.cpu_count()}, indent=2))
PY
cp "$OUT/egress-$stamp.json" "$OUT/egress-latest.json"
cat "$OUT/egress-$stamp.json"
