//! Sessions on Podman and Docker (runc) run in a pooled container whose PID 1, the pool
//! waiter, runs each command itself (`worker/src/backend/engine/pool/session.rs`). The
//! attack test first: the waiter is the session's uid with nothing to give (no
//! capability, non-dumpable, no signal from inside, no socket or directory left to
//! reach), on a container made for the session and on one claimed from the pool. Then
//! the node's side: an idle pooled container serves a session and goes with it, and a
//! node without the waiter binary still runs sessions, in a keep-alive container.

use serde_json::{json, Value};

use crate::harness::{engine_cli, env, session_guard, unique, Server};

fn create_body(session_id: &str) -> Value {
    json!({ "version": 1, "session_id": session_id, "task_id": unique("t"), "image": env().image })
}

/// Runs `sh -c script` in the session; (exit code, stdout, stderr).
async fn sh(sv: &Server, id: &str, script: &str) -> (i64, String, String) {
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{id}/exec"),
            &json!({ "version": 1, "command": ["sh", "-c", script] }),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    (
        v["exit_code"].as_i64().unwrap_or(-1),
        v["stdout"].as_str().unwrap_or_default().to_string(),
        v["stderr"].as_str().unwrap_or_default().to_string(),
    )
}

/// Creates a session on `sv`; its id, and the guard that removes its container.
async fn create(sv: &Server, backend: &str) -> (String, crate::harness::RemoveOnDrop) {
    let id = unique("s");
    let cleanup = session_guard(backend, &id);
    let (code, v) = sv.post("/v1/worker/sessions", &create_body(&id)).await;
    assert_eq!(code, 201, "{v}");
    (id, cleanup)
}

/// The command line of the session container's PID 1, as a command reads it.
async fn pid1(sv: &Server, id: &str) -> String {
    sh(sv, id, "tr '\\0' ' ' </proc/1/cmdline").await.1
}

/// A field of `/proc/<pid>/status` as the session reads it.
fn status_field(status: &str, key: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .unwrap_or_else(|| panic!("no {key} in {status}"))
        .trim()
        .to_string()
}

pub async fn the_sessions_init_is_the_waiter_and_gives_its_commands_nothing(backend: &'static str) {
    let sv = Server::start(backend, "");
    let (id, _cleanup) = create(&sv, backend).await;

    let cmdline = pid1(&sv, &id).await;
    assert!(
        cmdline.contains("cynode-pool-waiter"),
        "PID 1 is {cmdline:?}"
    );
    let (_, uid, _) = sh(&sv, &id, "id -u").await;
    let uid = uid.trim().to_string();
    assert_ne!(uid, "0");

    // The waiter: the session's uid for every id, no capability in any set, and no
    // way back (the bounding set is empty).
    let (_, init, _) = sh(&sv, &id, "cat /proc/1/status").await;
    for key in ["Uid", "Gid"] {
        let line = status_field(&init, key);
        let ids: Vec<&str> = line.split_whitespace().collect();
        assert!(ids.iter().all(|i| *i == uid), "{key} of PID 1: {ids:?}");
    }
    for key in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(
            status_field(&init, key),
            "0000000000000000",
            "{key} of PID 1"
        );
    }
    assert_eq!(status_field(&init, "NoNewPrivs"), "1");

    // A command: the same credentials, under the container's seccomp profile.
    let (_, own, _) = sh(&sv, &id, "cat /proc/self/status").await;
    for key in ["CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(
            status_field(&own, key),
            "0000000000000000",
            "{key} of a command"
        );
    }
    assert_eq!(status_field(&own, "NoNewPrivs"), "1");
    assert_eq!(status_field(&own, "Seccomp"), "2");

    // Nothing of the waiter is readable: it is non-dumpable, so its descriptors (the
    // control socket), memory and environment are root's.
    for probe in [
        "ls /proc/1/fd",
        "cat /proc/1/environ",
        "head -c 1 /proc/1/mem",
        "cat /proc/1/maps",
    ] {
        let (_, out, _) = sh(
            &sv,
            &id,
            &format!("{probe} >/dev/null 2>&1 && echo readable"),
        )
        .await;
        assert_eq!(out, "", "`{probe}` read the waiter's");
    }
    // The slot's directory (the waiter binary, the control socket's name) is unmounted:
    // its mount point is empty.
    let (_, out, _) = sh(&sv, &id, "ls -A /.cynode 2>/dev/null | wc -l").await;
    assert_eq!(out.trim(), "0", "/.cynode still holds something");

    // Signals from inside never reach it (it is the namespace's init and handles none).
    let (_, out, _) = sh(
        &sv,
        &id,
        "for s in KILL STOP TERM INT HUP SEGV CHLD; do kill -s $s 1 2>/dev/null; done; kill -9 -1; echo sent",
    )
    .await;
    assert!(out.contains("sent") || out.is_empty(), "{out:?}");
    let (code, out, _) = sh(&sv, &id, "echo alive").await;
    assert_eq!(
        (code, out.as_str()),
        (0, "alive\n"),
        "the session did not survive"
    );

    let (code, v) = sv
        .post(&format!("/v1/worker/sessions/{id}/end"), &json!({}))
        .await;
    assert_eq!(code, 200, "{v}");
}

/// A command that leaves a process holding its stdout and stderr: its output is whole
/// (the capture ends with the command, as an engine's `exec` does, and is not given up on
/// at the drain bound), and the next command runs beside the process left behind.
pub async fn a_process_left_holding_the_output_loses_the_command_nothing(backend: &'static str) {
    let sv = Server::start(backend, "");
    let (id, _cleanup) = create(&sv, backend).await;
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{id}/exec"),
            &json!({ "version": 1, "command": ["sh", "-c", "echo out; echo err >&2; sleep 300 & exit 4"] }),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        (&v["exit_code"], &v["stdout"], &v["stderr"], &v["truncated"]),
        (
            &json!(4),
            &json!("out\n"),
            &json!("err\n"),
            &json!({ "stdout": false, "stderr": false })
        ),
        "{v}"
    );
    let (_, out, _) = sh(&sv, &id, "pgrep -c sleep || ps | grep -c 'sleep 300'").await;
    assert_ne!(out.trim(), "0", "the process left behind is gone");
}

/// The container id a command of the session sees as its hostname (the engines name the
/// host so): how a test finds a claimed container, whose name is the pool's.
async fn container_of(sv: &Server, id: &str) -> String {
    let (_, host, _) = sh(sv, id, "cat /proc/sys/kernel/hostname").await;
    let host = host.trim().to_string();
    assert!(
        host.len() >= 12 && host.bytes().all(|b| b.is_ascii_hexdigit()),
        "{host}"
    );
    host
}

pub async fn an_idle_container_serves_the_session_and_goes_with_it(backend: &'static str) {
    let sv = Server::start(backend, "");
    let cli = engine_cli(backend).unwrap();
    let claims = crate::warm_pool::pool_metric(&sv, "claims_total").await;
    let (id, _cleanup) = create(&sv, backend).await;
    assert_eq!(
        crate::warm_pool::pool_metric(&sv, "claims_total").await,
        claims + 1,
        "the session did not take an idle container"
    );
    let container = container_of(&sv, &id).await;
    let running = crate::harness::engine_names(cli, &format!("id={container}"));
    assert_eq!(running.len(), 1, "{running:?}");
    assert!(running[0].starts_with("cynode-pool-"), "{running:?}");

    // The workspace is the session's, across commands.
    let (code, _, err) = sh(&sv, &id, "echo kept >/workspace/f").await;
    assert_eq!(code, 0, "{err}");
    let (_, out, _) = sh(&sv, &id, "cat /workspace/f").await;
    assert_eq!(out, "kept\n");

    let (code, v) = sv
        .post(&format!("/v1/worker/sessions/{id}/end"), &json!({}))
        .await;
    assert_eq!(code, 200, "{v}");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !crate::harness::engine_names(cli, &format!("id={container}")).is_empty()
        && std::time::Instant::now() < until
    {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        crate::harness::engine_names(cli, &format!("id={container}")),
        Vec::<String>::new(),
        "the session's container outlived it"
    );
}

pub async fn without_the_waiter_a_session_keeps_a_keepalive_container(backend: &'static str) {
    let missing = tempfile::tempdir().unwrap();
    let sv = Server::start(
        backend,
        &format!(
            "{}:\n  pool_waiter: {}\n",
            engine_cli(backend).unwrap(),
            missing.path().join("cynode-pool-waiter").display()
        ),
    );
    let (id, _cleanup) = create(&sv, backend).await;
    let cmdline = pid1(&sv, &id).await;
    assert!(
        !cmdline.contains("cynode-pool-waiter"),
        "PID 1 is {cmdline:?}"
    );
    let (code, out, _) = sh(&sv, &id, "echo hi; exit 3").await;
    assert_eq!((code, out.as_str()), (3, "hi\n"));
    let (code, v) = sv
        .post(&format!("/v1/worker/sessions/{id}/end"), &json!({}))
        .await;
    assert_eq!(code, 200, "{v}");
}

/// One test per case and backend: `podman` and `docker` (a container made for the
/// session), `podman_warm` and `docker_warm` (one claimed from the pool).
macro_rules! on_waiter_engines {
    ($($case:ident: [$($backend:ident),*]),* $(,)?) => { $( mod $case { $(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $backend() {
            crate::cases::setup();
            super::$case(stringify!($backend)).await;
        }
    )* } )* };
}

on_waiter_engines!(
    the_sessions_init_is_the_waiter_and_gives_its_commands_nothing:
        [podman, docker, podman_warm, docker_warm],
    a_process_left_holding_the_output_loses_the_command_nothing: [podman, docker],
    an_idle_container_serves_the_session_and_goes_with_it: [podman_warm, docker_warm],
    without_the_waiter_a_session_keeps_a_keepalive_container: [podman],
);
