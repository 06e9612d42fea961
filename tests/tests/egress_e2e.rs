//! Egress end to end: the real `cynode-pm` (scripted model) and a real
//! `cynode-worker` on bwrap with an egress ceiling naming an HTTP origin of the test's own
//! on 127.0.0.1 as an exact IP. A skill that declares that egress gets a job with
//! `network_policy: restricted` and its `egress_allow`; its step (busybox wget, which goes
//! through `http_proxy` even to 127.0.0.1) fetches the origin through the node's proxy,
//! and the session's history holds the `job_egress` audit. A skill whose egress goes
//! beyond the tenant's allowlist is refused by the policy gate (`egress_not_allowed`) and
//! never dispatched. `run`'s own local worker gets `--egress-allow` as its ceiling, and
//! without one its egress stays off. Only 127.0.0.1 is reached.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use cynode_testkit::OwnedChild;
use cynode_tests::{final_state, model_server, pm_with, rootfs, serve_in_background, TOKEN};
use serde_json::{json, Value};

/// The text the origin answers `GET /hello` with.
const HELLO: &str = "hello from the egress origin";

/// An HTTP origin on 127.0.0.1: `GET /hello` answers [`HELLO`]; counts its requests.
fn origin() -> (u16, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    let app = Router::new().route(
        "/hello",
        axum::routing::get(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            async { HELLO }
        }),
    );
    (serve_in_background(app).port(), hits)
}

/// A test-only skill `id` that declares network (and the egress `dest` when `declared`),
/// and whose one step fetches `http://{dest}/hello` with busybox wget (no `-T`: busybox
/// 1.35's wget dies of SIGSEGV with it in a sandbox; the job's own timeout bounds it).
fn fetch_skill(dir: &Path, id: &str, dest: &str, declared: bool) {
    let egress = if declared {
        format!("egress: [\"{dest}\"]\n")
    } else {
        String::new()
    };
    cynode_tests::write_skill(
        &dir.join(id),
        &format!(
            "skill_id: {id}\nversion: 1.0.0\ndescription: fetch the test origin through the node's egress proxy\npurpose: base-tools\nallowed_commands: [wget]\nnetwork: true\n{egress}limits:\n  max_runtime_seconds: 120\n  max_output_bytes: 65536\ninputs_schema:\n  type: object\n  additionalProperties: false\n  properties: {{}}\n"
        ),
        &format!(
            r#"{{ "constraints": {{ "max_runtime_seconds": 120, "max_output_bytes": 65536, "allowed_commands": ["wget"], "allowed_paths": ["/workspace"], "ext_net_allowed": true }},
  "steps": [ {{ "id": "fetch", "type": "run_command", "arguments": {{ "command": "wget", "args": ["-q", "-O", "-", "http://{dest}/hello"] }} }} ] }}"#
        ),
        "{}",
    );
}

/// Plans t1 (and t2 when `second` is given), requests `first` for t1 and `second` for
/// t2, then finishes.
fn script(first: &str, second: Option<&str>) -> Vec<Value> {
    let mut plan = vec![json!({ "op": "add", "path": "/plan/-", "value":
        { "task_id": "t1", "description": "fetch the origin", "status": "pending" } })];
    if second.is_some() {
        plan.push(json!({ "op": "add", "path": "/plan/-", "value":
            { "task_id": "t2", "description": "fetch further", "status": "pending" } }));
    }
    let mut s = vec![
        json!({ "type": "plan_update", "state_patch": plan, "payload": {} }),
        json!({ "type": "job_request", "state_patch": [], "payload":
            { "task_id": "t1", "skill_id": first, "inputs": {} } }),
    ];
    if let Some(id) = second {
        s.push(json!({ "type": "job_request", "state_patch": [], "payload":
            { "task_id": "t2", "skill_id": id, "inputs": {} } }));
    }
    s.push(json!({ "type": "final", "state_patch": [], "payload": { "summary": "fetched" } }));
    s
}

/// A `cynode-worker serve` on bwrap and the test image with `egress.allow: [allow]`.
struct EgressWorker {
    _child: OwnedChild,
    addr: String,
    _dir: cynode_tests::TempDir,
}

fn egress_worker(allow: &str) -> EgressWorker {
    use std::os::unix::fs::PermissionsExt;
    let dir = cynode_tests::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.path().join("token"), TOKEN).unwrap();
    let cfg = format!(
        "listen: 127.0.0.1:0\nbackend: bwrap\nstate_dir: {}\ntoken_file: {}\nbwrap:\n  rootfs:\n    \"localhost/cynode-sba-test:latest\": {}\negress:\n  allow: [\"{allow}\"]\n",
        dir.path().join("state").display(),
        dir.path().join("token").display(),
        rootfs().display()
    );
    std::fs::write(dir.path().join("w.yaml"), cfg).unwrap();
    let (child, addr) = cynode_tests::serve_worker(&dir.path().join("w.yaml"));
    EgressWorker {
        _child: child,
        addr,
        _dir: dir,
    }
}

/// The `job_egress` events of a final state, as (job_id, records).
fn egress_events(v: &Value) -> Vec<(String, Vec<Value>)> {
    v["state"]["history"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "job_egress")
        .map(|e| {
            (
                e["data"]["job_id"].as_str().unwrap().to_string(),
                e["data"]["records"].as_array().unwrap().clone(),
            )
        })
        .collect()
}

fn skills_args(skills: &Path) -> Vec<String> {
    vec![
        "--skill-dir".into(),
        "skills".into(),
        "--skill-dir".into(),
        skills.display().to_string(),
    ]
}

/// The brief's end to end: a restricted job reaches the origin through the worker's proxy
/// and is audited; a job beyond the tenant's allowlist is never dispatched.
#[test]
fn a_declared_egress_is_fetched_through_the_proxy_and_one_beyond_the_tenant_is_refused() {
    let (port, hits) = origin();
    let (far_port, far_hits) = origin();
    let dest = format!("127.0.0.1:{port}");
    let far = format!("127.0.0.1:{far_port}");
    let skills = cynode_tests::tempdir().unwrap();
    fetch_skill(skills.path(), "fetch-origin", &dest, true);
    fetch_skill(skills.path(), "fetch-far", &far, true);
    // The node's ceiling and the tenant (through --egress-allow) list only the first.
    let worker = egress_worker(&dest);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let front = rt.block_on(cynode_tests::worker::recording_front(
        worker.addr.clone(),
        seen.clone(),
    ));
    let (url, _model) = model_server(script("fetch-origin", Some("fetch-far")));
    let state = cynode_tests::tempdir().unwrap();
    let mut args: Vec<String> = vec![
        "run".into(),
        "fetch the origin".into(),
        "--worker-endpoint".into(),
        front,
        "--egress-allow".into(),
        dest.clone(),
    ];
    args.extend(skills_args(skills.path()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = pm_with(state.path(), &url, &args, &[("CYNODE_WORKER_TOKEN", TOKEN)]);
    let v = final_state(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);

    // One job dispatched, restricted to the skill's declared egress.
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}\n{stderr}");
    assert_eq!(
        seen[0]["sandbox"]["network_policy"], "restricted",
        "{}",
        seen[0]
    );
    assert_eq!(
        seen[0]["sandbox"]["egress_allow"],
        json!([dest]),
        "{}",
        seen[0]
    );
    assert_eq!(v["jobs_dispatched"], 1, "{v}");

    // Its step fetched the origin, through the proxy (the sandbox has no other route).
    assert_eq!(hits.load(Ordering::SeqCst), 1, "{v}\n{stderr}");
    let job_id = seen[0]["job_id"].as_str().unwrap();
    let egress = egress_events(&v);
    assert_eq!(egress.len(), 1, "{v}");
    assert_eq!(egress[0].0, job_id);
    let records = &egress[0].1;
    assert!(
        records.iter().any(|r| r["host"] == "127.0.0.1"
            && r["port"] == port
            && r["method"] == "GET"
            && r["decision"] == "allowed"
            && r["bytes_down"].as_u64() >= Some(HELLO.len() as u64)),
        "{records:?}"
    );
    assert!(v.to_string().contains(HELLO), "the step's output: {v}");

    // The second job: refused by the gate, the reason fed back, nothing sent.
    let denied: Vec<&Value> = v["state"]["history"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "policy_denied")
        .collect();
    assert_eq!(denied.len(), 1, "{v}");
    assert_eq!(denied[0]["data"]["task_id"], "t2");
    let reasons = denied[0]["data"]["reasons"].to_string();
    assert!(
        reasons.contains("egress_not_allowed") && reasons.contains(&far),
        "{reasons}"
    );
    assert_eq!(far_hits.load(Ordering::SeqCst), 0);
    assert!(stderr.contains("policy denied t2"), "{stderr}");

    // `sessions show` renders the stored audit.
    let id = v["state"]["session_id"].as_str().unwrap();
    let mut show = std::process::Command::new(cynode_tests::bin("cynode-pm"));
    show.args(["sessions", "show", id, "--state-dir"])
        .arg(state.path());
    let shown = cynode_testkit::output_bounded(show, std::time::Duration::from_secs(60));
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains(&format!("egress of job {job_id}:"))
            && shown.contains(&format!("allowed GET 127.0.0.1:{port}  ok")),
        "{shown}"
    );
}

/// `run` without a worker: its local worker's `egress.allow` is `--egress-allow`, so the
/// job reaches the origin; without any, a job with network (a tenant with
/// `allow_network`, a skill without declared egress) reaches nothing.
#[test]
fn runs_local_worker_gets_the_runs_egress_ceiling_and_none_without_it() {
    let (port, hits) = origin();
    let dest = format!("127.0.0.1:{port}");
    let skills = cynode_tests::tempdir().unwrap();
    fetch_skill(skills.path(), "fetch-origin", &dest, true);
    fetch_skill(skills.path(), "fetch-undeclared", &dest, false);

    let state = cynode_tests::tempdir().unwrap();
    let (url, _model) = model_server(script("fetch-origin", None));
    let mut args: Vec<String> = vec![
        "run".into(),
        "fetch the origin".into(),
        "--egress-allow".into(),
        dest.clone(),
    ];
    args.extend(skills_args(skills.path()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = pm_with(state.path(), &url, &args, &[]);
    let v = final_state(&out);
    assert_eq!(hits.load(Ordering::SeqCst), 1, "{v}");
    let egress = egress_events(&v);
    assert_eq!(egress.len(), 1, "{v}");
    assert!(
        egress[0]
            .1
            .iter()
            .any(|r| r["port"] == port && r["decision"] == "allowed"),
        "{egress:?}"
    );

    // No ceiling: the same fetch, from a skill that declares no egress (so the job gets
    // the worker's whole list), for a tenant that allows network, goes nowhere.
    let tenant_dir = cynode_tests::tempdir().unwrap();
    let tenant = tenant_dir.path().join("tenant.yaml");
    std::fs::write(&tenant, "tenant_id: default\nallow_network: true\n").unwrap();
    let state = cynode_tests::tempdir().unwrap();
    let (url, _model) = model_server(script("fetch-undeclared", None));
    let mut args: Vec<String> = vec![
        "run".into(),
        "fetch the origin".into(),
        "--tenant".into(),
        tenant.display().to_string(),
    ];
    args.extend(skills_args(skills.path()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = pm_with(state.path(), &url, &args, &[]);
    let v = final_state(&out);
    assert_eq!(v["jobs_dispatched"], 1, "{v}");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "reached without a ceiling: {v}"
    );
    assert!(
        egress_events(&v)
            .iter()
            .flat_map(|(_, r)| r)
            .all(|r| r["decision"] == "denied"),
        "{v}"
    );
}
