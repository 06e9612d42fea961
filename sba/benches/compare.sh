#!/usr/bin/env bash
# compare.sh — benchmark cynode-sba against plain baselines on this machine.
#
# Builds the release, statically linked runner, then times three cases with hyperfine:
#   a. runner overhead: a job with one `run_command` step of `true` vs spawning /bin/true
#      directly (both with hyperfine -N, no shell, started in the job's workspace with no
#      result.json yet, as a sandbox starts the runner), plus the runner's max RSS in that job;
#   b. apply_unified_diff of a 5,000-hunk patch over 500 files vs GNU `patch -p1`, each
#      run on a fresh copy of the same tree (hyperfine --prepare; the copy is synced to
#      disk first so no run pays for the previous run's writeback);
#   c. list_tree over 100,000 files (1,000 dirs x 100 files) vs `find -printf '%p %s\n'`.
# Each case is printed as a markdown table row (mean ± stddev, ratio to the baseline) and
# exported as hyperfine JSON. Generated trees and patches are deterministic and cached in
# the results directory between runs.
#
# Usage:  bash sba/benches/compare.sh
# Env:    CYNODE_BENCH_DIR   results and generated data (default /var/cache/cynode/bench)
#         CARGO_TARGET_DIR   cargo target dir (default /var/cache/cynode/target)
#         BENCH_SKIP_BUILD=1 use the binary already built in CARGO_TARGET_DIR
#         BENCH_RUNS_OVERHEAD, BENCH_RUNS_DIFF, BENCH_RUNS_TREE  hyperfine run counts
#         BENCH_MAX_LOAD, BENCH_MIN_IDLE  before timing, wait (up to BENCH_LOAD_WAIT s in all,
#                            default 300) until the 1-minute load average is below
#                            BENCH_MAX_LOAD (default 1.0) and the CPUs were at least
#                            BENCH_MIN_IDLE percent idle over 3 s (default 90); cases b and c
#                            each wait again for the idle condition
#         BENCH_PROFILE=1    also run `strace -c -w -f` (wall time per syscall) and `perf stat` once on case a
#
# Exit status: non-zero only on a setup error (missing tool, failed build, a job that does
# not succeed, trees that differ). A missed performance target is reported, not fatal.

set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BENCH_DIR=${CYNODE_BENCH_DIR:-/var/cache/cynode/bench}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cynode/target}
TRIPLE=x86_64-unknown-linux-gnu
SBA=$CARGO_TARGET_DIR/$TRIPLE/release/cynode-sba
RUNS_OVERHEAD=${BENCH_RUNS_OVERHEAD:-1000}
RUNS_DIFF=${BENCH_RUNS_DIFF:-30}
RUNS_TREE=${BENCH_RUNS_TREE:-30}
MAX_LOAD=${BENCH_MAX_LOAD:-1.0}
MIN_IDLE=${BENCH_MIN_IDLE:-90}
LOAD_WAIT=${BENCH_LOAD_WAIT:-300}

# Targets for case a.
TARGET_EXTRA_MS=1.5
TARGET_RSS_KIB=$((8 * 1024))

die() { echo "compare.sh: setup error: $*" >&2; exit 2; }
log() { echo "==> $*" >&2; }

for tool in hyperfine python3 patch diff find cargo; do
    command -v "$tool" >/dev/null || die "$tool not found (Debian: apt-get install -y hyperfine python3 patch diffutils findutils)"
done
GNU_TIME=
if [[ -x /usr/bin/time ]] && /usr/bin/time -f %M true >/dev/null 2>&1; then
    GNU_TIME=/usr/bin/time
fi

mkdir -p "$BENCH_DIR"
BENCH_DIR=$(cd "$BENCH_DIR" && pwd)
DATA=$BENCH_DIR/data
RES=$BENCH_DIR/results
mkdir -p "$DATA" "$RES"

# ---------------------------------------------------------------------------- build
if [[ ${BENCH_SKIP_BUILD:-0} != 1 ]]; then
    log "building $SBA (release, +crt-static)"
    (cd "$REPO_ROOT" && RUSTFLAGS="-C target-feature=+crt-static" \
        cargo build --release -p cynode-sba --target "$TRIPLE") || die "cargo build failed"
fi
[[ -x $SBA ]] || die "runner binary not found at $SBA"
if file "$SBA" 2>/dev/null | grep -q 'dynamically linked'; then
    die "$SBA is dynamically linked; expected a static binary"
fi

# -------------------------------------------------------------------- machine info
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "nproc: $(nproc)"
    echo "cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
    echo "kernel: $(uname -r)"
    echo "hyperfine: $(hyperfine --version)"
    echo "patch: $(patch --version | head -1)"
    echo "find: $(find --version | head -1)"
    echo "git: $(git -C "$REPO_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$REPO_ROOT" diff --quiet 2>/dev/null || echo ' (dirty tree)')"
    echo "binary: $SBA ($(stat -c %s "$SBA") bytes)"
} > "$RES/machine.txt"
cat "$RES/machine.txt" >&2

# A job directory: job.json, result.json, artifacts/. Job files are written by python.
run_job_once() { # job_dir workspace -> prints result.json path; dies unless status=success
    local jd=$1 ws=$2
    rm -rf "$jd/artifacts" "$jd/result.json"
    local rc=0
    "$SBA" --job "$jd/job.json" --result "$jd/result.json" --artifacts "$jd/artifacts" \
        --workspace "$ws" --allow-root >"$jd/log.jsonl" || rc=$?
    [[ $rc == 0 ]] || die "job in $jd exited $rc; see $jd/result.json and $jd/log.jsonl"
}

sba_cmd() { # job_dir workspace -> command line for hyperfine -N
    echo "$SBA --job $1/job.json --result $1/result.json --artifacts $1/artifacts --workspace $2 --allow-root"
}

# ------------------------------------------------------------------ generate data
GEN_VERSION=1

# a. overhead job
OVH=$DATA/overhead
mkdir -p "$OVH/job" "$OVH/ws"
python3 - "$OVH/job/job.json" <<'PY'
import json, sys
job = {
    "protocol_version": "1.0", "job_id": "bench-overhead", "task_id": "bench",
    "constraints": {"max_runtime_seconds": 60, "max_output_bytes": 65536},
    "steps": [{"id": "s1", "type": "run_command", "arguments": {"command": "true"}}],
}
open(sys.argv[1], "w").write(json.dumps(job))
PY

# b. 500 files x ~1000 lines, 10 hunks per file, diffed with `diff -ruN`.
DIFF=$DATA/diff
if [[ ! -f $DIFF/.complete-v$GEN_VERSION ]]; then
    log "generating diff tree (500 files x 1000 lines) and a 5,000-hunk patch"
    rm -rf "$DIFF"
    mkdir -p "$DIFF/job"
    python3 - "$DIFF" <<'PY'
import os, random, sys
root = sys.argv[1]
rng = random.Random(20240501)
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
         "omicron pi rho sigma tau upsilon phi chi psi omega return let fn if else "
         "match struct impl pub use mod self").split()
def line():
    n = rng.randint(3, 9)
    return "    " * rng.randint(0, 3) + " ".join(rng.choice(WORDS) for _ in range(n)) + "\n"
for d in range(25):
    for f in range(20):
        rel = f"src/mod{d:02d}/file{f:02d}.txt"
        old = [line() for _ in range(1000)]
        new = list(old)
        # 10 edits 100 lines apart (far more than 2x3 context lines: never merged).
        # Walk bottom-up so earlier indices stay valid.
        for h in reversed(range(10)):
            at = h * 100 + 50 + rng.randint(-5, 5)
            kind = rng.randrange(3)
            if kind == 0:            # change one line
                new[at] = line()
            elif kind == 1:          # insert two lines
                new[at:at] = [line(), line()]
            else:                    # delete one line, change the next
                new[at:at + 2] = [line()]
        for side, content in (("a", old), ("b", new)):
            p = os.path.join(root, side, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as fh:
                fh.writelines(content)
PY
    # Fixed, non-epoch mtimes: diff -N reads an epoch timestamp as "file absent".
    find "$DIFF/a" "$DIFF/b" -exec touch -h -d '2024-05-01 12:00:00 UTC' {} +
    (cd "$DIFF" && { diff -ruN a b > patch.diff || [[ $? == 1 ]]; }) || die "diff -ruN failed"
    python3 - "$DIFF/patch.diff" "$DIFF/job/job.json" <<'PY'
import json, sys
diff = open(sys.argv[1]).read()
hunks = sum(1 for l in diff.splitlines() if l.startswith("@@ "))
files = sum(1 for l in diff.splitlines() if l.startswith("+++ "))
if (hunks, files) != (5000, 500):
    sys.exit(f"generated patch has {hunks} hunks in {files} files, expected 5000 in 500")
job = {
    "protocol_version": "1.0", "job_id": "bench-apply-diff", "task_id": "bench",
    "constraints": {"max_runtime_seconds": 600, "max_output_bytes": 256 * 1024 * 1024},
    "steps": [{"id": "s1", "type": "apply_unified_diff", "arguments": {"diff": diff}}],
}
open(sys.argv[2], "w").write(json.dumps(job))
PY
    touch "$DIFF/.complete-v$GEN_VERSION"
fi

# c. 1,000 dirs x 100 files = 100,000 files.
TREE=$DATA/tree
if [[ ! -f $TREE/.complete-v$GEN_VERSION ]]; then
    log "generating list_tree tree (1,000 dirs x 100 files)"
    rm -rf "$TREE"
    mkdir -p "$TREE/job" "$TREE/ws"
    python3 - "$TREE/ws" <<'PY'
import os, random, sys
root = sys.argv[1]
rng = random.Random(20240502)
for d in range(1000):
    dp = os.path.join(root, f"pkg{d // 100:02d}", f"dir{d:04d}")
    os.makedirs(dp)
    for f in range(100):
        with open(os.path.join(dp, f"file{f:03d}.rs"), "wb") as fh:
            fh.write(b"x" * rng.randint(0, 2048))
PY
    python3 - "$TREE/job/job.json" <<'PY'
import json, sys
job = {
    "protocol_version": "1.0", "job_id": "bench-list-tree", "task_id": "bench",
    "constraints": {"max_runtime_seconds": 600, "max_output_bytes": 256 * 1024 * 1024},
    "steps": [{"id": "s1", "type": "list_tree", "arguments": {}}],
}
open(sys.argv[1], "w").write(json.dumps(job))
PY
    touch "$TREE/.complete-v$GEN_VERSION"
fi

# ------------------------------------------------------------- correctness checks
log "checking the jobs once, outside the timing"
run_job_once "$OVH/job" "$OVH/ws"

rm -rf "$DIFF/check-sba" "$DIFF/check-patch"
cp -a "$DIFF/a" "$DIFF/check-sba"
cp -a "$DIFF/a" "$DIFF/check-patch"
run_job_once "$DIFF/job" "$DIFF/check-sba"
patch -d "$DIFF/check-patch" -p1 -s -i "$DIFF/patch.diff" || die "GNU patch failed on the generated patch"
diff -r "$DIFF/check-sba" "$DIFF/check-patch" >/dev/null \
    || die "apply_unified_diff and patch -p1 produced different trees"
diff -r "$DIFF/check-sba" "$DIFF/b" >/dev/null \
    || die "apply_unified_diff result differs from the target tree"
python3 - "$DIFF/job/result.json" <<'PY' || die "apply_unified_diff result is not as expected"
import json, sys
r = json.load(open(sys.argv[1]))
s = r["steps"][0]
assert r["status"] == "success", r["status"]
n = len(s["result"]["files_modified"])
assert n == 500, f"{n} files modified"
print(f"apply_unified_diff: 500 files modified, step duration {s['duration_ms']} ms", file=sys.stderr)
PY
rm -rf "$DIFF/check-sba" "$DIFF/check-patch"

run_job_once "$TREE/job" "$TREE/ws"
python3 - "$TREE/job/result.json" <<'PY' || die "list_tree result is not as expected"
import json, sys
r = json.load(open(sys.argv[1]))
s = r["steps"][0]
assert r["status"] == "success", r["status"]
out = s["result"]
assert out["truncated"] is False, "list_tree output truncated"
files = dirs = 0
stack = [out["tree"]]
while stack:
    n = stack.pop()
    if n["type"] == "file":
        files += 1
    elif n["type"] == "dir":
        dirs += 1
        stack.extend(n.get("children") or [])
assert files == 100000, f"{files} files listed"
print(f"list_tree: {files} files, {dirs - 1} dirs, not truncated, step duration {s['duration_ms']} ms", file=sys.stderr)
PY
TREE_RESULT_BYTES=$(stat -c %s "$TREE/job/result.json")

# ------------------------------------------------------------------- quiet machine
# Other work on a 2-core box swamps millisecond timings. Wait (bounded) until the CPUs
# have been nearly idle for a few seconds and the 1-minute load average is low.
load1() { cut -d' ' -f1 /proc/loadavg; }
idle_pct() { # percent of CPU time idle over the next 3 seconds
    python3 - <<'IDLE'
import time
def snap():
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return f[3] + f[4], sum(f)
i0, t0 = snap(); time.sleep(3); i1, t1 = snap()
print(int(100 * (i1 - i0) / max(1, t1 - t0)))
IDLE
}
quiet() { # [check_load]: idle enough now (and, with an argument, a low 1-minute load)
    local idle max_load=1000
    [[ $# -gt 0 ]] && max_load=$MAX_LOAD
    idle=$(idle_pct)
    python3 -c "import sys; sys.exit(0 if $idle >= $MIN_IDLE and float('$(load1)') < float('$max_load') else 1)"
}
WAIT_START=$SECONDS
wait_quiet() { # [check_load]; bounded by LOAD_WAIT seconds over the whole script
    until quiet "$@"; do
        if (( SECONDS - WAIT_START >= LOAD_WAIT )); then
            log "machine still busy (load $(load1)); timing anyway, expect noise"
            return 0
        fi
        log "waiting for a quiet machine: load $(load1), want >= $MIN_IDLE% idle${1:+ and load < $MAX_LOAD}"
        sleep 7
    done
}
wait_quiet check_load
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
log "load average before timing: $LOAD_BEFORE"

# ------------------------------------------------------------------------- timing
log "a. runner overhead ($RUNS_OVERHEAD runs)"
# As a sandbox runs it: in the workspace (a sandbox's working directory is /workspace, so
# a step there starts without a chdir), and with no result.json yet (each job has a job
# directory of its own; replacing a file would make ext4 write it back at the rename).
(cd "$OVH/ws" && hyperfine -N --warmup 50 --runs "$RUNS_OVERHEAD" --export-json "$RES/overhead.json" \
    --prepare "rm -f $OVH/job/result.json" --prepare "true" \
    -n "cynode-sba run_command true" "$(sba_cmd "$OVH/job" "$OVH/ws")" \
    -n "/bin/true" "/bin/true")

log "a. max RSS (20 runs each)"
measure_rss() { # command... -> max RSS in KiB
    if [[ -n $GNU_TIME ]]; then
        "$GNU_TIME" -f %M -o "$RES/.rss" "$@" >/dev/null 2>&1 || die "rss run failed: $*"
        cat "$RES/.rss"
    else
        python3 -c '
import os, sys
pid = os.fork()
if pid == 0:
    fd = os.open(os.devnull, os.O_WRONLY); os.dup2(fd, 1); os.dup2(fd, 2)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, ru = os.wait4(pid, 0)
sys.exit(f"exit status {status}") if status else print(ru.ru_maxrss)
' "$@" || die "rss run failed: $*"
    fi
}
rss_series() { local i; for i in $(seq 20); do measure_rss "$@"; done | sort -n | tr '\n' ' '; }
# shellcheck disable=SC2046
RSS_SBA=$(rss_series $(sba_cmd "$OVH/job" "$OVH/ws"))
RSS_TRUE=$(rss_series /bin/true)
echo "max RSS KiB, cynode-sba: $RSS_SBA" > "$RES/rss.txt"
echo "max RSS KiB, /bin/true:  $RSS_TRUE" >> "$RES/rss.txt"
echo "measured with: ${GNU_TIME:-python3 os.wait4}" >> "$RES/rss.txt"

wait_quiet
log "b. apply_unified_diff vs patch -p1 ($RUNS_DIFF runs, fresh tree before each)"
hyperfine --warmup 3 --runs "$RUNS_DIFF" --export-json "$RES/apply_diff.json" \
    --prepare "rm -rf $DIFF/work && cp -a $DIFF/a $DIFF/work && sync" \
    -n "cynode-sba apply_unified_diff" "$(sba_cmd "$DIFF/job" "$DIFF/work")" \
    -n "patch -p1" "patch -d $DIFF/work -p1 -s -i $DIFF/patch.diff"
rm -rf "$DIFF/work"

wait_quiet
log "c. list_tree vs find ($RUNS_TREE runs)"
hyperfine -N --warmup 3 --runs "$RUNS_TREE" --export-json "$RES/list_tree.json" \
    -n "cynode-sba list_tree" "$(sba_cmd "$TREE/job" "$TREE/ws")" \
    -n "find -printf" "find $TREE/ws -printf '%p %s\\n'"
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

# ------------------------------------------------------------------ optional profile
if [[ ${BENCH_PROFILE:-0} == 1 ]]; then
    # shellcheck disable=SC2046
    if command -v strace >/dev/null; then
        log "strace -c -w -f of one overhead run -> $RES/strace-overhead.txt"
        strace -c -w -f -o "$RES/strace-overhead.txt" $(sba_cmd "$OVH/job" "$OVH/ws") >/dev/null
    fi
    # shellcheck disable=SC2046
    if command -v perf >/dev/null; then
        log "perf stat -r 200 of the overhead run -> $RES/perf-overhead.txt"
        perf stat -r 200 -o "$RES/perf-overhead.txt" $(sba_cmd "$OVH/job" "$OVH/ws") >/dev/null \
            || log "perf stat failed (no perf events in this VM?)"
    fi
fi

# ------------------------------------------------------------------------ summary
python3 - "$RES" "$TARGET_EXTRA_MS" "$TARGET_RSS_KIB" "$LOAD_BEFORE" "$LOAD_AFTER" \
    "$TREE_RESULT_BYTES" "$RSS_SBA" "$RSS_TRUE" <<'PY' | tee "$RES/summary.md"
import json, os, statistics, sys, time
res, target_ms, target_kib, load_before, load_after, tree_bytes, rss_sba, rss_true = sys.argv[1:]
target_ms, target_kib = float(target_ms), int(target_kib)

def load(name):
    return json.load(open(os.path.join(res, name)))["results"]

def fmt(r):
    m, s = r["mean"], r["stddev"] or 0.0
    if m < 1:
        return f"{m * 1e3:.2f} ± {s * 1e3:.2f} ms"
    return f"{m:.3f} ± {s:.3f} s"

print("| case | cynode-sba | baseline | ratio |")
print("|---|---|---|---|")
rows = [("a. run_command `true` vs `/bin/true`", "overhead.json"),
        ("b. apply_unified_diff 5,000 hunks / 500 files vs `patch -p1`", "apply_diff.json"),
        ("c. list_tree 100,000 files vs `find -printf`", "list_tree.json")]
results = {}
for title, f in rows:
    sba, base = load(f)
    results[f] = (sba, base)
    print(f"| {title} | {fmt(sba)} | {fmt(base)} | {sba['mean'] / base['mean']:.2f}x |")

sba, base = results["overhead.json"]
extra_ms = (sba["mean"] - base["mean"]) * 1e3
extra_med_ms = (sba["median"] - base["median"]) * 1e3
rss = [int(x) for x in rss_sba.split()]
rss_t = [int(x) for x in rss_true.split()]
rss_max = max(rss)
print()
print("Targets (case a):")
print(f"- extra wall time: {extra_ms:.2f} ms mean ({extra_med_ms:.2f} ms median), target < {target_ms:g} ms: "
      + ("MET" if extra_ms < target_ms else f"MISSED by {extra_ms - target_ms:.2f} ms"))
print(f"- max RSS: {rss_max} KiB ({rss_max / 1024:.1f} MiB; median {statistics.median(rss)} KiB over {len(rss)} runs; "
      f"/bin/true {max(rss_t)} KiB), target < {target_kib} KiB: "
      + ("MET" if rss_max < target_kib else f"MISSED by {rss_max - target_kib} KiB"))
print()
for f in ("overhead.json", "apply_diff.json", "list_tree.json"):
    sba, base = results[f]
    print(f"- {f[:-5]}: cynode-sba min {sba['min'] * 1e3:.2f} / median {sba['median'] * 1e3:.2f} ms, "
          f"user {sba['user'] * 1e3:.1f} + sys {sba['system'] * 1e3:.1f} ms; "
          f"baseline min {base['min'] * 1e3:.2f} / median {base['median'] * 1e3:.2f} ms, "
          f"user {base['user'] * 1e3:.1f} + sys {base['system'] * 1e3:.1f} ms")
print(f"- list_tree result.json size: {int(tree_bytes) / 1e6:.1f} MB")
print(f"- load average before timing: {load_before}; after: {load_after}")
print(f"- hyperfine JSON: {res}/{{overhead,apply_diff,list_tree}}.json; case a's figures in {res}/summary.json")

# Case a for deploy/perf-headline.py (PERFORMANCE.md's headline table).
def ms(r):
    return {"mean_ms": r["mean"] * 1e3, "stddev_ms": (r["stddev"] or 0.0) * 1e3,
            "median_ms": r["median"] * 1e3, "min_ms": r["min"] * 1e3}
sba, base = results["overhead.json"]
with open(os.path.join(res, "summary.json"), "w") as f:
    json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "load_before": load_before, "load_after": load_after,
               "sba": ms(sba), "baseline": ms(base), "max_rss_kib": rss_max}, f, indent=2)
PY
