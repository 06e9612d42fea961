//! Requests shaped as upstream CyNodeAI's orchestrator sends them
//! (`go_shared_libs/contracts/workerapi`): `"command": null` on an SBA dispatch, an empty
//! `image` that falls back to the node's default image, and `use_inference` on a node
//! without an inference upstream; and our answers as upstream's orchestrator decodes
//! them (cynode_testkit::upstream mirrors its types with Go's JSON semantics). Tests
//! named `<feature>__<scenario>` follow upstream's BDD features/worker_node/*.feature.
#![allow(non_snake_case)]

use serde_json::{json, Value};

use crate::harness::{env, sba_job, unique, Server};

/// An upstream SBA dispatch: `command` is null (no omitempty upstream), `image` empty.
fn upstream_dispatch(id: &str) -> Value {
    let mut req = sba_job(
        id,
        id,
        json!([{ "id": "s1", "type": "run_command", "arguments": { "command": "true" } }]),
        json!([]),
    );
    req["sandbox"]["command"] = Value::Null;
    req["sandbox"]["image"] = json!("");
    req["sandbox"]["use_inference"] = json!(true);
    req
}

#[tokio::test]
async fn worker_node_sba_an_upstream_dispatch_runs_in_the_default_image() {
    let sv = Server::start("bwrap", &format!("default_image: {}\n", env().image));
    let id = unique("up");
    let (code, v) = sv
        .post("/v1/worker/jobs:run", &upstream_dispatch(&id))
        .await;
    assert_eq!(
        (code, v["status"].clone(), v["sba_result"]["status"].clone()),
        (200, json!("completed"), json!("success")),
        "{v}"
    );
}

#[tokio::test]
async fn an_empty_image_without_a_default_is_refused_by_field() {
    let sv = Server::start("bwrap", "");
    let id = unique("up");
    let (code, v) = sv
        .post("/v1/worker/jobs:run", &upstream_dispatch(&id))
        .await;
    assert_eq!(
        (code, v["detail"].clone()),
        (400, json!("sandbox.image: must not be empty")),
        "{v}"
    );
}

/// The same dispatch with no `image` at all: read as an empty one.
fn dispatch_without_image(id: &str) -> Value {
    let mut req = upstream_dispatch(id);
    req["sandbox"].as_object_mut().unwrap().remove("image");
    req
}

#[tokio::test]
async fn worker_node_sba_a_dispatch_without_image_runs_in_the_default_image() {
    let sv = Server::start("bwrap", &format!("default_image: {}\n", env().image));
    let id = unique("up");
    let (code, v) = sv
        .post("/v1/worker/jobs", &dispatch_without_image(&id))
        .await;
    assert_eq!(code, 202, "{v}");
    let (code, v) = sv
        .post(
            "/v1/worker/jobs:run",
            &dispatch_without_image(&unique("up")),
        )
        .await;
    assert_eq!(
        (code, v["status"].clone(), v["sba_result"]["status"].clone()),
        (200, json!("completed"), json!("success")),
        "{v}"
    );
}

#[tokio::test]
async fn a_missing_image_without_a_default_is_refused_by_field() {
    let sv = Server::start("bwrap", "");
    for path in ["/v1/worker/jobs:run", "/v1/worker/jobs"] {
        let (code, v) = sv.post(path, &dispatch_without_image(&unique("up"))).await;
        assert_eq!(
            (code, v["detail"].clone()),
            (400, json!("sandbox.image: must not be empty")),
            "{path}: {v}"
        );
    }
}

/// A request of another `version` is refused as such, before any field of it is read:
/// not "missing field image" nor "unknown field" of a shape this node does not speak.
#[tokio::test]
async fn an_unsupported_version_is_named_before_any_field() {
    let sv = Server::start("bwrap", "");
    let mut surprise = upstream_dispatch(&unique("up"));
    surprise["sandbox"]["from_v2"] = json!(true);
    surprise["priority"] = json!(1);
    let mut bad_id = dispatch_without_image(&unique("up"));
    bad_id["task_id"] = json!("../x");
    for mut body in [dispatch_without_image(&unique("up")), surprise, bad_id] {
        body["version"] = json!(2);
        for path in ["/v1/worker/jobs:run", "/v1/worker/jobs"] {
            let (code, v) = sv.post(path, &body).await;
            assert_eq!(
                (code, v["detail"].clone()),
                (400, json!("version: unsupported version 2: expected 1")),
                "{path}: {v}"
            );
        }
    }
}

/// An upstream orchestrator's SBA dispatch, marshalled from the mirror of its
/// `workerapi.RunJobRequest` (Go's encoding: `command: null`, zero fields omitted) with a
/// job.json marshalled from the mirror of `sbajob.JobSpec` (steps `{type, args}`).
fn upstream_sba_request(id: &str, steps: Value) -> Value {
    use cynode_testkit::upstream as up;
    let spec = up::JobSpec {
        protocol_version: "1.0".into(),
        job_id: id.into(),
        task_id: id.into(),
        constraints: up::JobConstraints {
            max_runtime_seconds: 60,
            max_output_bytes: 65536,
            ext_net_allowed: false,
        },
        steps: Some(serde_json::from_value(steps).unwrap()),
        ..Default::default()
    };
    let req = up::RunJobRequest {
        version: 1,
        task_id: id.into(),
        job_id: id.into(),
        sandbox: up::SandboxSpec {
            image: env().image.clone(),
            job_spec_json: serde_json::to_string(&spec).unwrap(),
            ..Default::default()
        },
    };
    serde_json::to_value(req).unwrap()
}

/// Our answer as upstream's orchestrator decodes it (`workerapi.RunJobResponse`, whose
/// `sba_result` is a `*sbajob.Result`).
fn as_upstream(v: &Value) -> cynode_testkit::upstream::RunJobResponse {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| {
        panic!("upstream's RunJobResponse cannot decode our answer: {e}\n{v:#}")
    })
}

#[tokio::test]
async fn worker_node_sba__sba_result_contract_from_task_result_is_validated_only_when_task_is_completed(
) {
    let sv = Server::start("bwrap", "");
    let id = unique("up-steps");
    let req = upstream_sba_request(
        &id,
        json!([
            { "type": "write_file", "args": { "path": "/greeting.txt", "content": "hello\n" } },
            { "type": "run_command", "args": { "argv": ["cat", "greeting.txt"] } }
        ]),
    );
    let (code, v) = sv.post("/v1/worker/jobs:run", &req).await;
    assert_eq!(code, 200, "{v}");
    let r = as_upstream(&v);
    assert_eq!(r.status, "completed", "{v:#}");
    let sba = r.sba_result.expect("sba_result");
    assert_eq!(
        (sba.protocol_version.as_str(), sba.status.as_str()),
        ("1.0", "success")
    );
    assert_eq!(sba.job_id, id);
    assert!(v["sba_result"]["artifacts"].is_array(), "{v:#}");
    let steps: Vec<(i64, String, Option<i64>, String)> = sba
        .steps
        .unwrap()
        .into_iter()
        .map(|s| (s.index, s.status, s.exit_code, s.output))
        .collect();
    assert_eq!(
        steps,
        [
            (0, "success".to_string(), None, String::new()),
            (1, "success".to_string(), Some(0), "hello\n".to_string()),
        ]
    );
}

/// A job whose step failed still reaches an upstream orchestrator with
/// its result (a step's `error` is a string).
#[tokio::test]
async fn worker_node_sba__a_failed_step_decodes_with_upstreams_result_type() {
    let sv = Server::start("bwrap", "");
    let id = unique("up-fail");
    let req = upstream_sba_request(
        &id,
        json!([{ "type": "run_command", "args": { "argv": ["sh", "-c", "echo no >&2; exit 4"] } }]),
    );
    let (code, v) = sv.post("/v1/worker/jobs:run", &req).await;
    assert_eq!(code, 200, "{v}");
    let r = as_upstream(&v);
    assert_eq!(r.status, "failed", "{v:#}");
    let sba = r.sba_result.expect("sba_result");
    assert_eq!(sba.failure_code.as_deref(), Some("step_failed"));
    let step = &sba.steps.unwrap()[0];
    assert_eq!(
        (
            step.status.as_str(),
            step.exit_code,
            step.output.as_str(),
            step.error.as_str()
        ),
        (
            "failure",
            Some(4),
            "no\n",
            "command `sh` exited with status 4"
        )
    );
}

#[tokio::test]
async fn worker_node_sandbox_execution__worker_api_runs_a_sandbox_job_and_returns_stdout_and_exit_code(
) {
    let sv = Server::start("bwrap", "");
    let id = unique("up-echo");
    let req = cynode_testkit::upstream::RunJobRequest {
        version: 1,
        task_id: "bdd-task".into(),
        job_id: id,
        sandbox: cynode_testkit::upstream::SandboxSpec {
            image: env().image.clone(),
            command: Some(vec!["sh".into(), "-c".into(), "echo hello".into()]),
            network_policy: "restricted".into(),
            ..Default::default()
        },
    };
    let (code, v) = sv
        .post("/v1/worker/jobs:run", &serde_json::to_value(req).unwrap())
        .await;
    assert_eq!(code, 200, "{v}");
    let r = as_upstream(&v);
    assert_eq!(
        (r.status.as_str(), r.exit_code, r.stdout.as_str()),
        ("completed", 0, "hello\n"),
        "{v:#}"
    );
}
