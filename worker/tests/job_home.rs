//! The job's user and home on every backend: which uid a job and a session's command run
//! as inside (uid 1000 under bwrap's user namespace and in the microVM's guest, the
//! workspace's own host uid under Podman, Docker and gVisor), and that `HOME` is a
//! writable directory of the sandbox's own whatever that uid is (the image's home belongs
//! to uid 1000 and sits on a read-only root), so `pip install --user` of a wheel in the
//! workspace works and the package imports. In the Python test image (busybox, the
//! runner, the host's Debian python3 and pip).

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::{session_guard, unique, Server};

on_every_backend!(
    job_home:
    home_is_writable_and_pip_user_installs,
);

/// The wheel's file name: package `homepkg` 0.1, pure Python.
const WHEEL: &str = "homepkg-0.1-py3-none-any.whl";

/// What the job and the session's command run: their uid, `HOME`, a file written there,
/// then `pip install --user` of the workspace's wheel and the import from a fresh
/// interpreter, from `/` (so the workspace is not on its path). The image's Debian Python
/// is "externally managed" (PEP 668), which refuses even `--user` installs unless told
/// otherwise: the variable says so, as a user of such a Python would.
const SCRIPT: &str = "set -e; echo uid=$(id -u); echo home=$HOME; \
    echo written > \"$HOME/.cynode-home-probe\"; cat \"$HOME/.cynode-home-probe\"; \
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --user --no-index --no-cache-dir \
      --disable-pip-version-check -q ./homepkg-0.1-py3-none-any.whl; \
    cd /; python3 -c 'import homepkg; print(homepkg.VALUE); print(homepkg.__file__)'";

/// The uid a sandbox over the workspace owned by host uid `ws_uid` runs as inside.
fn uid_inside(backend: &str, ws_uid: u32) -> u32 {
    match backend {
        // bwrap's user namespace maps the workspace's host uid to 1000; the microVM's
        // guest init drops to 1000 (a guest uid, of a kernel of its own).
        "bwrap" | "microvm" => 1000,
        // The engines run `--user N:N` with no user namespace: the host uid itself.
        _ => ws_uid,
    }
}

/// The stdout of a completed run of [`SCRIPT`] (`what`: job or session), checked.
fn check(backend: &str, what: &str, v: &Value, uid: u32) {
    assert_eq!(
        (v["status"].clone(), v["exit_code"].clone()),
        (json!("completed"), json!(0)),
        "{backend} {what}: {v}"
    );
    let out = v["stdout"].as_str().unwrap_or_default();
    eprintln!("{backend} {what}: {out}");
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some(format!("uid={uid}").as_str()), "{v}");
    let home = lines
        .next()
        .and_then(|l| l.strip_prefix("home="))
        .unwrap_or_default();
    assert!(
        home.starts_with('/') && home.len() > 1,
        "{backend} {what}: {v}"
    );
    assert_eq!(lines.next(), Some("written"), "{v}");
    assert_eq!(lines.next(), Some("installed into HOME"), "{v}");
    let module = lines.next().unwrap_or_default();
    assert!(
        module.starts_with(&format!("{home}/.local/lib/python3"))
            && module.ends_with("/site-packages/homepkg/__init__.py"),
        "{backend} {what}: not a --user install under HOME: {v}"
    );
}

/// A job, then a session's command, over a workspace holding a wheel.
pub async fn home_is_writable_and_pip_user_installs(backend: &'static str) {
    let (image, rootfs) = crate::egress_jobs::python_image();
    if backend == "docker" {
        crate::harness::docker_ready();
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        cynode_testkit::setup_script(&root, &["deploy/docker/start.sh", image]);
    }
    tokio::time::timeout(Duration::from_secs(240), async {
        // Continues the harness's `bwrap.rootfs` map (also the microVM's root filesystems;
        // the engines run the image itself).
        let sv = Server::start(backend, &format!("    \"{image}\": {}\n", rootfs.display()));
        let ws = unique("ws");
        let wheel = crate::harness::wheel("homepkg", "installed into HOME");
        let (code, v) = sv
            .put_tar(&ws, crate::workspaces::tar_of(&[(WHEEL, &wheel)]))
            .await;
        assert_eq!(code, 201, "{v}");
        let ws_uid = std::fs::metadata(sv.state_dir().join("workspaces").join(&ws))
            .unwrap()
            .uid();
        assert!(ws_uid >= 0x7000_0000, "not from sandbox_uids: {ws_uid}");
        let uid = uid_inside(backend, ws_uid);

        let mut job = crate::harness::command_job(&unique("j"), "t", &["sh", "-c", SCRIPT]);
        job["workspace_id"] = json!(ws);
        job["sandbox"]["image"] = image.as_str().into();
        let (code, v) = sv.post("/v1/worker/jobs:run", &job).await;
        assert_eq!(code, 200, "{v}");
        check(backend, "job", &v, uid);
        // A microVM session runs each command as a job's VM (`PerCommand`): the job above
        // is that path, and a second guest under TCG about doubles the test's time.
        if backend == "microvm" {
            return;
        }

        let session = unique("s");
        let _cleanup = session_guard(backend, &session);
        let body = json!({
            "version": 1, "session_id": session, "task_id": unique("t"),
            "workspace_id": ws, "image": image,
        });
        let (code, v) = sv.post("/v1/worker/sessions", &body).await;
        assert_eq!(code, 201, "{v}");
        let exec = format!("/v1/worker/sessions/{session}/exec");
        let (code, v) = sv
            .post(
                &exec,
                &json!({ "version": 1, "command": ["sh", "-c", SCRIPT] }),
            )
            .await;
        assert_eq!(code, 200, "{v}");
        check(backend, "session", &v, uid);
        let (code, v) = sv
            .post(&format!("/v1/worker/sessions/{session}/end"), &json!({}))
            .await;
        assert_eq!(code, 200, "{v}");
    })
    .await
    .unwrap();
}
