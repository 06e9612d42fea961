//! Policy gate benchmark: one evaluation of the default policy per job (target p50 < 1 ms).
//!
//! `cargo bench -p cynode-pm --bench policy` runs criterion over three jobs (a typical
//! skill job, a job the policy denies on several rules, a large job with 40 steps and a
//! 400-line diff) on the gate's engine (regorus' strict interpreter, `evaluate/…`), then
//! times 5,000 single evaluations of each and prints p50/p90/p99. Criterion's own report
//! is in target/criterion.

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::Criterion;
use cynode_pm::policy::{Decision, LocalGate, Mode, PolicyInput, TenantPolicy};
use serde_json::{json, Value};

fn skill() -> Value {
    json!({
        "skill_id": "go-test",
        "version": "1.0.0",
        "description": "run the tests of a Go module",
        "purpose": "go-tools",
        "allowed_commands": ["go", "git", "gofmt"],
        "network": false,
        "limits": {"max_runtime_seconds": 900, "max_output_bytes": 4194304},
        "inputs_schema": {"type": "object", "properties": {"package": {"type": "string"}}}
    })
}

fn job(steps: Value) -> Value {
    json!({
        "protocol_version": "1.0",
        "job_id": "7d1b7f2e-0000-5000-8000-000000000001",
        "task_id": "task-1",
        "skill_id": "go-test",
        "constraints": {
            "max_runtime_seconds": 300, "max_output_bytes": 1048576,
            "allowed_commands": ["go", "git"], "allowed_paths": ["/workspace"]
        },
        "artifacts": ["coverage.out", "reports/**"],
        "steps": steps
    })
}

/// What a built-in "run the Go tests" skill renders.
fn typical() -> Value {
    job(json!([
        {"id": "tree", "type": "list_tree", "arguments": {"path": ".", "max_depth": 3}},
        {"id": "gomod", "type": "read_file", "arguments": {"path": "go.mod"}},
        {"id": "test", "type": "run_command", "arguments": {
            "command": "go", "args": ["test", "-coverprofile=coverage.out", "./..."],
            "working_dir": "/workspace", "env": {"CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"},
            "timeout_seconds": 240}},
        {"id": "diff", "type": "run_command", "arguments": {"command": "git", "args": ["diff", "--stat"]}}
    ]))
}

/// Denied on command, path, secret, git and network rules at once.
fn denied() -> Value {
    let mut j = job(json!([
        {"id": "fetch", "type": "run_command", "arguments": {"command": "curl", "args": ["https://example.com"]}},
        {"id": "read", "type": "read_file", "arguments": {"path": "../../etc/passwd"}},
        {"id": "push", "type": "run_command", "arguments": {"command": "git", "args": ["-C", "repo", "push"],
            "env": {"GITHUB_TOKEN": "ghp_0123456789abcdefghijABCDEFGHIJklmnop"}}}
    ]));
    j["constraints"]["ext_net_allowed"] = json!(true);
    j
}

/// 40 steps of every kind and a 400-line diff.
fn large() -> Value {
    let mut diff = String::new();
    for f in 0..20 {
        diff.push_str(&format!(
            "--- a/pkg/f{f}.go\n+++ b/pkg/f{f}.go\n@@ -1,9 +1,9 @@\n"
        ));
        for l in 0..9 {
            diff.push_str(&format!(" line {l}\n"));
        }
        diff.push_str("-old\n+new\n");
    }
    let mut steps = Vec::new();
    for i in 0..8 {
        steps.push(json!({"id": format!("w{i}"), "type": "write_file", "arguments": {"path": format!("src/f{i}.go"), "content": "package x\n"}}));
        steps.push(json!({"id": format!("r{i}"), "type": "read_file", "arguments": {"path": format!("/workspace/src/f{i}.go")}}));
        steps.push(json!({"id": format!("s{i}"), "type": "search_files", "arguments": {"pattern": "TODO", "path": "src"}}));
        steps.push(json!({"id": format!("t{i}"), "type": "run_command", "arguments": {
            "command": "go", "args": ["test", format!("./pkg/{i}/...")], "env": {"GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}}}));
        steps.push(json!({"id": format!("g{i}"), "type": "run_command", "arguments": {"command": "git", "args": ["-c", "core.pager=cat", "log", "-n", "5"]}}));
    }
    steps.push(json!({"id": "patch", "type": "apply_unified_diff", "arguments": {"diff": diff}}));
    job(Value::Array(steps))
}

fn inputs() -> Vec<(&'static str, PolicyInput)> {
    [
        ("typical", typical()),
        ("denied", denied()),
        ("large", large()),
    ]
    .into_iter()
    .map(|(name, job)| {
        (
            name,
            PolicyInput::new(job, skill(), TenantPolicy::default()),
        )
    })
    .collect()
}

fn load_gate() -> LocalGate {
    // CYNODE_POLICY_DIR benchmarks another policy directory (e.g. a draft).
    let dir = std::env::var_os("CYNODE_POLICY_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies"));
    match LocalGate::from_dir(&dir, Mode::Enforce) {
        Ok(gate) => gate,
        Err(e) => panic!("cannot load {}: {e}", dir.display()),
    }
}

fn bench(c: &mut Criterion, gate: &LocalGate) {
    let mut group = c.benchmark_group("policy");
    for (name, input) in inputs() {
        group.bench_function(format!("evaluate/{name}"), |b| {
            b.iter(|| gate.evaluate_sync(black_box(&input)))
        });
    }
    group.bench_function("load_default_policy", |b| b.iter(load_gate));
    group.finish();
}

type Evaluate = fn(&LocalGate, &PolicyInput) -> Decision;

/// Times single evaluations (not batched) and prints their percentiles.
fn percentiles(gate: &LocalGate) {
    const RUNS: usize = 5_000;
    let engines: [(&str, Evaluate); 1] = [("evaluate", LocalGate::evaluate_sync)];
    for (engine, evaluate) in engines {
        for (name, input) in inputs() {
            for _ in 0..200 {
                black_box(evaluate(gate, &input));
            }
            let mut times: Vec<Duration> = (0..RUNS)
                .map(|_| {
                    let start = Instant::now();
                    black_box(evaluate(gate, black_box(&input)));
                    start.elapsed()
                })
                .collect();
            times.sort();
            let at = |q: f64| times[((RUNS as f64 - 1.0) * q) as usize];
            let decision = evaluate(gate, &input);
            println!(
                "policy {engine}/{name:<8} p50 {:>9.1?}  p90 {:>9.1?}  p99 {:>9.1?}  ({RUNS} runs; allowed={}, deny={}, warn={})",
                at(0.50),
                at(0.90),
                at(0.99),
                decision.allowed,
                decision.deny.len(),
                decision.warn.len()
            );
        }
    }
}

fn main() {
    let gate = load_gate();
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    bench(&mut c, &gate);
    c.final_summary();
    percentiles(&gate);
}
