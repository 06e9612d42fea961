//! Agent-compatible images on the real worker: an agent job (and a session with the
//! node's models) runs only on an image labelled `io.cynodeai.sandbox.agent-compatible=true`
//! (the engine's metadata; beside a bwrap rootfs, `<rootfs>.labels.json`), is refused as
//! `image_not_agent_compatible` on the unlabelled test image
//! (deploy/sba/build-unlabelled-test-image.sh) unless the node allows it, and basic jobs
//! never need the label. Then the label file's attacks: a link, a FIFO, a huge or
//! malformed file, and a label the image writes into its own root filesystem.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cynode_testkit::scripted_model::{Reply, ScriptedModel};
use serde_json::{json, Value};

use crate::harness::{command_job, env, gates_egress, sba_job, unique, Server};

on_both_backends!(agent_images:
    labelled_image_runs_an_agent_job,
    unlabelled_image_is_refused_for_agents,
    the_node_may_allow_unlabelled_images,
    basic_jobs_need_no_label,
);

const UNLABELLED: &str = "localhost/cynode-sba-test-unlabelled:latest";
const NAMED: &str = "image_not_agent_compatible";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The unlabelled test image, built once (the script is idempotent and locked), loaded
/// into Docker for docker; its root filesystem (with its label file beside) for bwrap.
fn unlabelled(backend: &str) -> &'static Path {
    static ROOTFS: OnceLock<PathBuf> = OnceLock::new();
    let rootfs = ROOTFS.get_or_init(|| {
        env();
        cynode_testkit::setup_script(&repo(), &["deploy/sba/build-unlabelled-test-image.sh"]);
        PathBuf::from(cynode_testkit::setup_script(
            &repo(),
            &["deploy/sba/export-rootfs.sh", UNLABELLED],
        ))
    });
    if crate::harness::engine_cli(backend) == Some("docker") {
        crate::harness::docker_ready();
        cynode_testkit::setup_script(&repo(), &["deploy/docker/start.sh", UNLABELLED]);
    }
    rootfs
}

/// Config lines that add the unlabelled image's rootfs to the harness's `bwrap.rootfs`
/// (they follow its one entry), then `extra`.
fn with_unlabelled(backend: &str, extra: &str) -> String {
    format!(
        "    \"{UNLABELLED}\": {}\n{extra}",
        unlabelled(backend).display()
    )
}

fn agent_job(id: &str, image: &str) -> Value {
    let spec = json!({
        "protocol_version": "1.0", "job_id": id, "task_id": id,
        "execution_mode": "agent_inference",
        "inference": { "allowed_models": ["smollm2"] },
        "constraints": { "max_runtime_seconds": 60, "max_output_bytes": 65536 },
        "context": { "task_context": "say done" }
    });
    json!({
        "version": 1, "task_id": id, "job_id": id,
        "sandbox": { "image": image, "job_spec_json": spec.to_string() }
    })
}

/// A model that finishes at once.
fn finishing_model() -> String {
    ScriptedModel::repeating_last(vec![Reply::from(json!({
        "thought": "",
        "action": { "type": "finish", "arguments": { "status": "success", "final_answer": "done" } }
    }))])
    .serve()
}

/// The node's inference upstream where the backend can bind the listener; gVisor cannot
/// (its jobs with a model are refused as `inference_listener_unavailable`), so there an
/// agent job runs without a model and is only shown past acceptance.
fn inference_lines(backend: &str) -> String {
    if gates_egress(backend) {
        format!(
            "inference:\n  base_url: {}\n  models: [smollm2]\n",
            finishing_model()
        )
    } else {
        String::new()
    }
}

fn assert_named_refusal(code: u16, v: &Value, field: &str) {
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["type"], "urn:cynodeai:error:validation", "{v}");
    let detail = v["detail"].as_str().unwrap_or_default();
    assert!(
        detail.starts_with(&format!("{field}: {NAMED}: image `")),
        "{detail}"
    );
}

pub async fn labelled_image_runs_an_agent_job(backend: &'static str) {
    let sv = Server::start(backend, &inference_lines(backend));
    let id = unique("agent-ok");
    let (code, v) = sv
        .post("/v1/worker/jobs:run", &agent_job(&id, &env().image))
        .await;
    assert_eq!(code, 200, "{v}");
    if gates_egress(backend) {
        assert_eq!(v["status"], "completed", "{v}");
        assert_eq!(v["sba_result"]["final_answer"], "done", "{v}");
    } else {
        assert!(!v.to_string().contains(NAMED), "{v}");
    }
}

pub async fn unlabelled_image_is_refused_for_agents(backend: &'static str) {
    let lines = with_unlabelled(backend, &inference_lines(backend));
    let sv = Server::start(backend, &lines);
    let id = unique("agent-no");
    let (code, v) = sv
        .post("/v1/worker/jobs:run", &agent_job(&id, UNLABELLED))
        .await;
    assert_named_refusal(code, &v, "sandbox.image");
    // Nothing was recorded or created for it.
    let (code, _) = sv.get(&format!("/v1/worker/jobs/{id}")).await;
    assert_eq!(code, 404);
    assert!(!sv.state_dir().join("jobs").join(&id).exists());
    // The queued path refuses it the same way.
    let (code, v) = sv
        .post(
            "/v1/worker/jobs",
            &agent_job(&unique("agent-no"), UNLABELLED),
        )
        .await;
    assert_named_refusal(code, &v, "sandbox.image");
    if gates_egress(backend) {
        // A session with the node's models hosts an agent: refused the same way, and
        // started on the labelled image.
        let session = |sid: &str, image: &str| {
            json!({ "version": 1, "session_id": sid, "task_id": sid, "image": image,
                    "use_inference": true })
        };
        let sid = unique("s-no");
        let _guard = crate::harness::session_guard(backend, &sid);
        let (code, v) = sv
            .post("/v1/worker/sessions", &session(&sid, UNLABELLED))
            .await;
        assert_named_refusal(code, &v, "image");
        let sid = unique("s-ok");
        let _guard = crate::harness::session_guard(backend, &sid);
        let (code, v) = sv
            .post("/v1/worker/sessions", &session(&sid, &env().image))
            .await;
        assert_eq!(code, 201, "{v}");
        let (code, v) = sv
            .post(&format!("/v1/worker/sessions/{sid}/end"), &json!({}))
            .await;
        assert!(code < 300, "{code} {v}");
    }
}

pub async fn the_node_may_allow_unlabelled_images(backend: &'static str) {
    let lines = with_unlabelled(
        backend,
        &format!(
            "allow_unlabelled_agent_images: true\n{}",
            inference_lines(backend)
        ),
    );
    let sv = Server::start(backend, &lines);
    let id = unique("agent-allowed");
    let (code, v) = sv
        .post("/v1/worker/jobs:run", &agent_job(&id, UNLABELLED))
        .await;
    assert_eq!(code, 200, "{v}");
    assert!(!v.to_string().contains(NAMED), "{v}");
    if gates_egress(backend) {
        assert_eq!(v["status"], "completed", "{v}");
    }
}

pub async fn basic_jobs_need_no_label(backend: &'static str) {
    let sv = Server::start(backend, &with_unlabelled(backend, ""));
    let mut cmd = command_job(&unique("basic"), "t-basic", &["echo", "plain"]);
    cmd["sandbox"]["image"] = json!(UNLABELLED);
    let (code, v) = sv.post("/v1/worker/jobs:run", &cmd).await;
    assert_eq!(
        (code, v["status"].clone()),
        (200, json!("completed")),
        "{v}"
    );
    let id = unique("steps");
    let mut steps = sba_job(
        &id,
        "t-basic",
        json!([{ "id": "e", "type": "run_command", "arguments": { "command": "echo", "args": ["steps"] } }]),
        json!([]),
    );
    steps["sandbox"]["image"] = json!(UNLABELLED);
    let (code, v) = sv.post("/v1/worker/jobs:run", &steps).await;
    assert_eq!(
        (code, v["status"].clone()),
        (200, json!("completed")),
        "{v}"
    );
}

/// A bwrap node whose image `localhost/attack:latest` has the root filesystem `rootfs`.
fn attack_node(rootfs: &Path) -> Server {
    Server::start(
        "bwrap",
        &format!("    \"localhost/attack:latest\": {}\n", rootfs.display()),
    )
}

/// The label file beside a rootfs is read without following links, regular files only,
/// bounded: each attack is the named refusal, quickly, and the node keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bwrap_label_file_attacks_are_refused() {
    env();
    let dir = tempfile::tempdir().unwrap();
    // The image's own root filesystem: a copy is not needed, the real one is linked in
    // through a directory of the test's (the label file is looked for beside the path
    // the config names).
    let rootfs = dir.path().join("img");
    std::os::unix::fs::symlink(&env().rootfs, &rootfs).unwrap();
    let labels = dir.path().join("img.labels.json");
    let sv = attack_node(&rootfs);
    let good_labels = label_file_of(&env().rootfs);
    let attempt = |what: &'static str| {
        let sv = &sv;
        async move {
            let (code, v) = sv
                .post(
                    "/v1/worker/jobs:run",
                    &agent_job(&unique("atk"), "localhost/attack:latest"),
                )
                .await;
            eprintln!("{what}: {v}");
            (code, v)
        }
    };
    // No label file: no labels.
    let (code, v) = attempt("missing").await;
    assert_named_refusal(code, &v, "sandbox.image");
    // A link to a labelled file is not followed.
    std::os::unix::fs::symlink(&good_labels, &labels).unwrap();
    let (code, v) = attempt("symlink").await;
    assert_named_refusal(code, &v, "sandbox.image");
    assert!(v["detail"].as_str().unwrap().contains("link"), "{v}");
    std::fs::remove_file(&labels).unwrap();
    // A FIFO never blocks the node.
    nix_mkfifo(&labels);
    let (code, v) = attempt("fifo").await;
    assert_named_refusal(code, &v, "sandbox.image");
    std::fs::remove_file(&labels).unwrap();
    // A directory.
    std::fs::create_dir(&labels).unwrap();
    let (code, v) = attempt("directory").await;
    assert_named_refusal(code, &v, "sandbox.image");
    std::fs::remove_dir(&labels).unwrap();
    // Huge: over the bound, never read whole.
    let f = std::fs::File::create(&labels).unwrap();
    f.set_len(1 << 30).unwrap();
    drop(f);
    let (code, v) = attempt("huge").await;
    assert_named_refusal(code, &v, "sandbox.image");
    assert!(v["detail"].as_str().unwrap().contains("bytes"), "{v}");
    // Malformed, and the wrong value.
    for bad in [
        "{\"io.cynodeai.sandbox.agent-compatible\": true}",
        "[\"io.cynodeai.sandbox.agent-compatible\"]",
        "{\"io.cynodeai.sandbox.agent-compatible\": \"True\"}",
        "not json",
    ] {
        std::fs::write(&labels, bad).unwrap();
        let (code, v) = attempt("malformed").await;
        assert_named_refusal(code, &v, "sandbox.image");
    }
    // The right label, in a regular file beside: accepted (the job then runs).
    std::fs::copy(&good_labels, &labels).unwrap();
    let (code, v) = attempt("labelled").await;
    assert_eq!(code, 200, "{v}");
}

/// A label the image writes into its own root filesystem says nothing: only the file
/// beside it counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_inside_the_rootfs_is_ignored() {
    env();
    let dir = tempfile::tempdir().unwrap();
    let rootfs = dir.path().join("img");
    std::fs::create_dir(&rootfs).unwrap();
    let claim = r#"{"io.cynodeai.sandbox.agent-compatible": "true"}"#;
    for name in [".labels.json", "labels.json", "img.labels.json"] {
        std::fs::write(rootfs.join(name), claim).unwrap();
    }
    let sv = attack_node(&rootfs);
    let (code, v) = sv
        .post(
            "/v1/worker/jobs:run",
            &agent_job(&unique("inside"), "localhost/attack:latest"),
        )
        .await;
    assert_named_refusal(code, &v, "sandbox.image");
}

/// `<rootfs>.labels.json`.
pub fn label_file_of(rootfs: &Path) -> PathBuf {
    let mut name = rootfs.file_name().unwrap().to_os_string();
    name.push(".labels.json");
    rootfs.with_file_name(name)
}

fn nix_mkfifo(path: &Path) {
    let out = std::process::Command::new("mkfifo")
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// `cynode-worker check` names each configured image's agent label.
#[test]
fn check_reports_the_agent_label() {
    unlabelled("bwrap");
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t0123456789abcdef0123").unwrap();
    let config = dir.path().join("worker.yaml");
    std::fs::write(
        &config,
        format!(
            "backend: bwrap\nstate_dir: {}\ntoken_file: {}\nimages: [\"{}\", \"{UNLABELLED}\"]\nbwrap:\n  rootfs:\n    \"{}\": {}\n    \"{UNLABELLED}\": {}\n",
            dir.path().join("state").display(),
            token.display(),
            env().image,
            env().image,
            env().rootfs.display(),
            unlabelled("bwrap").display()
        ),
    )
    .unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cynode-worker"));
    cmd.arg("check").arg("--config").arg(&config);
    let out = cynode_testkit::output_bounded(cmd, std::time::Duration::from_secs(60));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!(
            "ok   image {}: agent-compatible (io.cynodeai.sandbox.agent-compatible=true)",
            env().image
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "ok   image {UNLABELLED}: not agent-compatible (no io.cynodeai.sandbox.agent-compatible label)"
        )),
        "{text}"
    );
}
