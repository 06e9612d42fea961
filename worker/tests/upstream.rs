//! Requests shaped as upstream CyNodeAI's orchestrator sends them
//! (`go_shared_libs/contracts/workerapi`): `"command": null` on an SBA dispatch, an empty
//! `image` that falls back to the node's default image, and `use_inference` on a node
//! without an inference upstream.

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
