#!/usr/bin/env python3
"""Regenerates the headline table of docs/PERFORMANCE.md from the benches' JSON.

Usage:
  python3 deploy/perf-headline.py            rewrite the table from the JSON found
  python3 deploy/perf-headline.py --check    only check that the table's rows are this
                                             script's rows, in order (exit 1 if not)
Options:
  --bench-dir DIR   where the benches wrote their JSON [$CYNODE_BENCH_DIR or
                    /var/cache/cynode/bench]
  --doc FILE        the document [docs/PERFORMANCE.md beside this repository's deploy/]

Each row of the table is one entry of ROWS below: its figure (the first cell, which
names the row), the bench file it is read from, and how. A row whose file is absent, or
whose file was written under other conditions than the figure names (another pool size),
is kept as the document has it, and the script says so. A row with no bench file is
written by hand, and stays as it is.
"""

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional

BEGIN = "<!-- headline:begin (deploy/perf-headline.py) -->"
END = "<!-- headline:end -->"
HEADER = [
    "| figure | value | anchor | ratio | date | load |",
    "|---|---|---|---|---|---|",
]

# The independent medians computesdk/benchmarks gives for a sandbox's time to interactive.
DAYTONA_TTI_MS = 204
# An exec through `podman exec`, measured on 2026-12-02 (PERFORMANCE.md, sessions).
PODMAN_EXEC_MS = 149


class Skip(Exception):
    """The file does not hold this row's figure."""


@dataclass
class Row:
    figure: str
    source: Optional[str]
    extract: Optional[Callable[[dict], list]]


def day(stamp: str) -> str:
    """`20261204T191629Z` or `2026-12-04T19:16:29Z` -> `2026-12-04`."""
    digits = re.sub(r"[^0-9]", "", stamp)[:8]
    if len(digits) != 8:
        raise Skip(f"no date in {stamp!r}")
    return f"{digits[:4]}-{digits[4:6]}-{digits[6:8]}"


def load(before, after) -> str:
    """The 1-minute load averages before and after a run, as `a–b` (one figure when equal)."""
    first = lambda v: float(str(v).split()[0])
    a, b = sorted([f"{first(before):.1f}", f"{first(after):.1f}"], key=float)
    return a if a == b else f"{a}–{b}"


def when(j: dict) -> list:
    """The date and load cells of a bench file that records `date`, `load_before` and
    `load_after` at its top."""
    return [day(j["date"]), load(j["load_before"], j["load_after"])]


def when_env(j: dict) -> list:
    """The same for worker/benches/compare.sh's summary, which keeps them in `env`."""
    env = j["env"]
    return [day(env["stamp"]), load(env["loadavg"]["start"], env["loadavg"]["end"])]


def worker_podman(j: dict) -> list:
    p = j["podman"]
    worker, bare = p["worker_http"]["p50_ms"], p["bare_hyperfine"]["median_ms"]
    return [
        f"p50 {worker:.1f} ms",
        f"bare `podman run`, same flags, {bare:.1f} ms",
        f"{p['ratio_median']:.2f}×",
    ] + when_env(j)


def worker_bwrap_cold(j: dict) -> list:
    b = j["bwrap"]
    worker, bare = b["worker_http"]["p50_ms"], b["bare_hyperfine"]["median_ms"]
    return [f"p50 {worker:.2f} ms", f"bare `bwrap`, {bare:.2f} ms", f"{worker / bare:.2f}×"] + when_env(j)


def build(worker: str) -> str:
    return " (debug build)" if "/debug/" in worker else ""


def sba_overhead(j: dict) -> list:
    s, b = j["sba"], j["baseline"]
    return [
        f"{s['mean_ms']:.2f} ± {s['stddev_ms']:.2f} ms (median {s['median_ms']:.2f})",
        f"bare `/bin/true`, {b['mean_ms']:.2f} ± {b['stddev_ms']:.2f} ms (median {b['median_ms']:.2f})",
        f"+{s['median_ms'] - b['median_ms']:.2f} ms",
    ] + when(j)


def session(engine: str, pool: Optional[int], step: str, anchor: str, anchor_ms: float):
    def extract(j: dict) -> list:
        if pool is not None and j.get("pool_size") != pool:
            raise Skip(f"pool_size {j.get('pool_size')!r}, the figure names {pool}")
        rows = [r for r in j["results"] if r["engine"] == engine]
        if not rows:
            raise Skip(f"no {engine} results")
        p50 = rows[0][step]["p50"]
        return [
            f"p50 {p50:g} ms{build(j['worker'])}",
            anchor,
            f"{p50 / anchor_ms:.2f}×",
        ] + when(j)

    return extract


def egress_trivial(j: dict) -> list:
    t = j["trivial_job"]
    return [
        f"p50 {t['on_p50_ms']:.1f} ms",
        f"the same job with `none`, {t['off_p50_ms']:.1f} ms; goal < 3 ms extra",
        f"{t['extra_p50_ms']:+.1f} ms",
    ] + when(j)


SESSION_STATE = "worker/session-state-latest.json"
WORKER_COMPARE = "worker/latest.json"
ROWS = [
    Row("a `run_command true` job in cynode-sba", "results/summary.json", sba_overhead),
    Row("a trivial job through the worker, Podman", WORKER_COMPARE, worker_podman),
    Row("a trivial job through the worker, bwrap, warm sandboxes", None, None),
    Row("the same, bwrap cold", WORKER_COMPARE, worker_bwrap_cold),
    Row("a trivial job, Podman with a warm pool of 2", None, None),
    Row("a trivial job, Docker with a warm pool of 2", None, None),
    Row("a `restricted` (egress proxy) job, Podman, pool off", None, None),
    Row("a trivial bwrap job, `restricted` (egress proxy) against `none`",
        "worker/egress-latest.json", egress_trivial),
    Row("a session's time to interactive, Podman with a pool of 2", SESSION_STATE,
        session("podman", 2, "time_to_interactive_ms",
                f"Daytona's median, {DAYTONA_TTI_MS} ms (computesdk/benchmarks)", DAYTONA_TTI_MS)),
    Row("a session's time to interactive, bwrap", SESSION_STATE,
        session("bwrap", None, "time_to_interactive_ms", "the goal, 50 ms", 50)),
    Row("an exec in a running session, Podman with a pool of 2", SESSION_STATE,
        session("podman", 2, "exec_ms",
                f"the same through `podman exec`, {PODMAN_EXEC_MS} ms (2026-12-02)", PODMAN_EXEC_MS)),
    Row("the PM's overhead per turn (scripted instant model, SQLite)", None, None),
    Row("policy evaluation of a typical skill job", None, None),
    Row("sessions on one PM process, 1,000 at once, SQLite", None, None),
    Row("the inference proxy, `GET /v1/models`", None, None),
    Row("microVM cold boot to job (TCG: no usable KVM here)", None, None),
]


def cells(line: str) -> list:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table(doc: str):
    """(text before, the table's row lines, text after)."""
    try:
        head, rest = doc.split(BEGIN + "\n", 1)
        body, tail = rest.split(END, 1)
    except ValueError:
        sys.exit(f"perf-headline: the document has no {BEGIN} … {END} block")
    lines = [l for l in body.splitlines() if l.startswith("|")]
    if lines[:2] != HEADER:
        sys.exit("perf-headline: the table's header is not " + HEADER[0])
    return head, lines[2:], tail


def check(rows: list) -> list:
    """The differences between the table's figures and ROWS."""
    have = [cells(l)[0] for l in rows]
    want = [r.figure for r in ROWS]
    if have == want:
        return []
    missing = [f for f in want if f not in have]
    extra = [f for f in have if f not in want]
    out = [f"not in the table: {f}" for f in missing] + [f"not in ROWS: {f}" for f in extra]
    return out or ["the rows are in another order than ROWS"]


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description="Regenerates PERFORMANCE.md's headline table.")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench-dir", default=os.environ.get("CYNODE_BENCH_DIR", "/var/cache/cynode/bench"))
    ap.add_argument("--doc", default=os.path.join(here, "..", "docs", "PERFORMANCE.md"))
    args = ap.parse_args()

    doc = open(args.doc, encoding="utf-8").read()
    head, rows, tail = table(doc)
    problems = check(rows)
    if problems:
        for p in problems:
            print(f"perf-headline: {p}", file=sys.stderr)
        return 1
    if args.check:
        return 0

    out = []
    for row, line in zip(ROWS, rows):
        if row.source is None:
            out.append(line)
            continue
        path = os.path.join(args.bench_dir, row.source)
        try:
            with open(path, encoding="utf-8") as f:
                values = row.extract(json.load(f))
        except FileNotFoundError:
            print(f"perf-headline: kept `{row.figure}`: no {path}", file=sys.stderr)
            out.append(line)
            continue
        except (Skip, KeyError, ValueError, TypeError) as e:
            print(f"perf-headline: kept `{row.figure}`: {path}: {e!r}", file=sys.stderr)
            out.append(line)
            continue
        out.append("| " + " | ".join([row.figure] + values) + " |")
        print(f"perf-headline: `{row.figure}` from {path}", file=sys.stderr)
    new = head + BEGIN + "\n" + "\n".join(HEADER + out) + "\n" + END + tail
    if new != doc:
        with open(args.doc, "w", encoding="utf-8") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
