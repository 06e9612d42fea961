#!/usr/bin/env bash
# Runs the README's main job (deploy/run-demo.sh's `cynode-pm run` on the embedded
# defaults) several times on each of three ordinary objectives about examples/workspace,
# and prints one table row per objective: runs, runs that dispatched at least one job into
# the sandbox, runs that completed with a deliverable, runs that did both, runs whose
# deliverable summary babbles (the same 4-word clause 3 times or more, the PM's own rule in
# pm/src/llm/contract/babble.rs), jobs dispatched per run, and wall time per run (median
# and max). The table goes in docs/PERFORMANCE.md.
#
#   bash deploy/measure-demo.sh [RUNS]        (RUNS per objective, default 5)
#
# Set-up is deploy/run-demo.sh's (install-deps, static runner, sandbox image, release
# build, the local model on port 8089); it is done once, before the first run, and not
# timed. Each run gets a fresh state directory and a fresh copy of the workspace, and is
# non-interactive (stdin is /dev/null), like a newcomer's `bash deploy/run-demo.sh` in CI.
# Per-run details (exit code, jobs, status, wall time, the deliverable's first line) go to
# stderr and to $OUT/runs.tsv; each run's JSON session record, log and database (with the
# model's raw replies in its journal) are kept in $OUT.
#
# Environment: CYNODE_MODEL_BASE_URL / CYNODE_MODEL_NAME (another model), PM_BIN (a
# cynode-pm binary to measure instead of the release build), OUT (where records go).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cynode/target}"
RUNS="${1:-5}"
OUT="${OUT:-$(mktemp -d /var/tmp/cynode-measure.XXXXXX)}"
mkdir -p "$OUT"

OBJECTIVES=(
  "List the files in the workspace, then finish with a one-sentence summary of what the project does."
  "Read README.md in the workspace and summarize what it says."
  "Find where the function greet is defined in the workspace code."
)

if [[ -z ${PM_BIN:-} ]]; then
  bash deploy/install-deps.sh >&2
  bin=$(bash deploy/sba/build-static.sh)
  bash deploy/sba/build-test-image.sh "$bin" >/dev/null
  cargo build --release -p cynode-pm -p cynode-worker >&2
  PM_BIN="$CARGO_TARGET_DIR/release/cynode-pm"
fi
if [[ -z ${CYNODE_MODEL_BASE_URL:-} ]]; then
  export "$(bash deploy/llm/start.sh 8089)"
fi

median() { sort -n | awk '{a[NR]=$1} END {if (NR==0) print 0; else if (NR%2) print a[(NR+1)/2]; else printf "%.1f\n", (a[NR/2]+a[NR/2+1])/2}'; }

printf 'objective\trun\texit\tstatus\tjobs\tbabble\tseconds\tdeliverable\n' >"$OUT/runs.tsv"
echo "| objective | runs | dispatched ≥ 1 job | completed with a deliverable | both | summary repeats a clause | jobs per run | wall time per run (median / max) |"
echo "|---|---|---|---|---|---|---|---|"
for o in "${!OBJECTIVES[@]}"; do
  objective="${OBJECTIVES[$o]}"
  dispatched=0 completed=0 both=0 babble=0 jobs_list="" secs_list=""
  for ((r = 1; r <= RUNS; r++)); do
    run=$(mktemp -d /var/tmp/cynode-measure-run.XXXXXX)
    chmod 0755 "$run"
    cp -r examples/workspace "$run/workspace"
    start=$(date +%s%N)
    set +e
    "$PM_BIN" --output json run "$objective" --workspace "$run/workspace" \
      --state-dir "$run/state" </dev/null >"$OUT/o$o-r$r.json" 2>"$OUT/o$o-r$r.log"
    code=$?
    set -e
    secs=$((($(date +%s%N) - start) / 1000000000))
    read -r status jobs babbles summary < <(python3 - "$OUT/o$o-r$r.json" <<'EOF'
import collections, json, re, sys
try:
    rec = json.load(open(sys.argv[1]))
except Exception:
    print("no-record 0 0 -"); sys.exit()
d = rec.get("deliverable") or {}
full = d.get("summary") or ""
words = [w.lower() for w in re.split(r"[^\w']+", full) if w]
grams = collections.Counter(tuple(words[i:i + 4]) for i in range(len(words) - 3))
babbles = int(any(n >= 3 for n in grams.values()))
s = " ".join((full or "-").split())[:80]
print(rec.get("status"), rec.get("jobs_dispatched", 0), babbles, s)
EOF
    )
    ((jobs > 0)) && dispatched=$((dispatched + 1))
    [[ $status == completed ]] && completed=$((completed + 1))
    ((jobs > 0)) && [[ $status == completed ]] && both=$((both + 1))
    ((babbles > 0)) && babble=$((babble + 1))
    jobs_list+="$jobs "
    secs_list+="$secs "
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$o" "$r" "$code" "$status" "$jobs" "$babbles" "$secs" "$summary" >>"$OUT/runs.tsv"
    printf 'objective %s run %s: exit %s, %s, %s jobs, babble %s, %ss: %s\n' "$o" "$r" "$code" "$status" "$jobs" "$babbles" "$secs" "$summary" >&2
    cp "$run/state/pm.db" "$OUT/o$o-r$r.db" 2>/dev/null || true
    rm -rf "$run"
  done
  med=$(tr ' ' '\n' <<<"$secs_list" | grep . | median)
  max=$(tr ' ' '\n' <<<"$secs_list" | grep . | sort -n | tail -1)
  echo "| $objective | $RUNS | $dispatched | $completed | **$both** | $babble | ${jobs_list% } | ${med} s / ${max} s |"
done
echo "records: $OUT" >&2
