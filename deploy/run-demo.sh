#!/usr/bin/env bash
# The main job of this repository today: install what is needed, build the static runner
# and the worker, build the offline sandbox image, start a local cynode-worker (Podman
# backend, SQLite job records, loopback only), submit examples/jobs/hello.json to it over
# the Worker API, and print the response with the SBA's result.json. The PM (LLM loop) is
# a later milestone; see README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cynode/target}"

bash deploy/install-deps.sh >&2
bin=$(bash deploy/sba/build-static.sh)
image_id=$(bash deploy/sba/build-test-image.sh "$bin")
cargo build --release -p cynode-worker >&2
worker="$CARGO_TARGET_DIR/release/cynode-worker"

state=$(mktemp -d /var/tmp/cynode-demo.XXXXXX)
chmod 0755 "$state"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$state/token"
"$worker" serve --listen 127.0.0.1:0 --backend podman --state-dir "$state/state" \
  --token-file "$state/token" 2>"$state/worker.log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
addr=""
for _ in $(seq 1 200); do
  addr=$(grep -o '"addr":"[^"]*"' "$state/worker.log" | head -1 | cut -d'"' -f4 || true)
  [[ -n $addr ]] && break
  sleep 0.05
done
[[ -n $addr ]] || { cat "$state/worker.log" >&2; echo "worker did not start" >&2; exit 1; }
echo "cynode-worker on $addr (image ${image_id:0:12}, state in $state)" >&2

python3 - "$addr" "$state/token" examples/jobs/hello.json <<'PY'
import json, sys, urllib.request
addr, token_file, job_file = sys.argv[1:4]
token = open(token_file).read().strip()
job = json.load(open(job_file))
body = {"version": 1, "task_id": job["task_id"], "job_id": job["job_id"],
        "sandbox": {"image": "localhost/cynode-sba-test:latest", "job_spec_json": json.dumps(job)}}
req = urllib.request.Request(f"http://{addr}/v1/worker/jobs:run", data=json.dumps(body).encode(),
                             headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
resp = json.load(urllib.request.urlopen(req, timeout=120))
resp["stdout"] = f"<{len(resp['stdout'])} bytes of the runner's JSON log>"
print(json.dumps(resp, indent=2))
sys.exit(0 if resp["status"] == "completed" else 1)
PY
