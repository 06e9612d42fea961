//! Session sandboxes on the real server, once per backend: lifecycle with a persisted
//! workspace, idle timeout enforced by the reaper, exec timeout, auth, strict bodies.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{
    assert_field_starts, env, marker, process_with_arg, session_guard, unique, RemoveOnDrop,
    Server, TOKEN,
};

on_both_backends!(
    sessions:
    lifecycle_keeps_the_workspace_and_removes_the_sandbox,
    idle_timeout_ends_the_session,
    exec_timeout_kills_the_command_and_the_session_lives_on,
    max_lifetime_ends_a_running_command,
    one_command_at_a_time,
    a_command_cannot_end_its_container_and_its_death_ends_the_session,
    background_process_ends_with_the_session,
    auth_is_required,
    invalid_requests_name_the_field,
);

// On the microVM (each command a VM of its own under TCG here): the cases that show its
// sessions keep their promises, not every one again.
on_both_backends!(@one sessions microvm [
    lifecycle_keeps_the_workspace_and_removes_the_sandbox,
    exec_timeout_kills_the_command_and_the_session_lives_on,
    a_command_cannot_end_its_container_and_its_death_ends_the_session,
    background_process_ends_with_the_session
]);

fn create_body(session_id: &str, task_id: &str) -> Value {
    json!({ "version": 1, "session_id": session_id, "task_id": task_id, "image": env().image })
}

fn exec_body(command: &[&str]) -> Value {
    json!({ "version": 1, "command": command })
}

/// Containers named for the session, running or not, on the engine of `backend`.
fn session_containers(backend: &str, session_id: &str) -> Vec<String> {
    crate::harness::engine_cli(backend).map_or_else(Vec::new, |cli| {
        crate::harness::engine_names(cli, &format!("name=^cynode-session-{session_id}$"))
    })
}

/// A session a test created.
struct Created {
    id: String,
    /// Its exec path.
    exec: String,
    /// The create response.
    info: Value,
    /// Removes its container however the test ends: bind it for the whole test.
    _cleanup: RemoveOnDrop,
}

/// Creates a session (its create body changed by `tweak`) and asserts 201.
async fn create_session(sv: &Server, tweak: impl FnOnce(&mut Value)) -> Created {
    let id = unique("s");
    let cleanup = session_guard(sv.backend, &id);
    let mut body = create_body(&id, &unique("t"));
    tweak(&mut body);
    let (code, info) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 201, "{info}");
    let exec = format!("/v1/worker/sessions/{id}/exec");
    Created {
        id,
        exec,
        info,
        _cleanup: cleanup,
    }
}

fn assert_no_container(sv: &Server, session_id: &str) {
    if crate::harness::is_engine(sv.backend) {
        assert_eq!(
            session_containers(sv.backend, session_id),
            Vec::<String>::new(),
            "container left for session {session_id}"
        );
    }
}

/// The fields of an exec response that do not depend on the clock.
fn outcome(v: &Value) -> Value {
    json!({
        "status": v["status"], "exit_code": v["exit_code"], "stdout": v["stdout"],
        "stderr": v["stderr"], "truncated": v["truncated"]
    })
}

fn ok(stdout: &str) -> Value {
    json!({ "status": "completed", "exit_code": 0, "stdout": stdout, "stderr": "",
            "truncated": { "stdout": false, "stderr": false } })
}

/// `v` without its timestamps, after checking they are there.
fn without_times(v: &Value) -> Value {
    let mut v = v.clone();
    for k in ["created_at", "expires_at", "ended_at"] {
        if let Some(t) = v.as_object_mut().and_then(|o| o.remove(k)) {
            assert!(t.as_str().is_some_and(|s| s.ends_with('Z')), "{k}: {t}");
        }
    }
    v
}

pub async fn lifecycle_keeps_the_workspace_and_removes_the_sandbox(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("s");
    let _cleanup = session_guard(sv.backend, &id);
    let task = unique("t");
    let mut body = create_body(&id, &task);
    body["env"] = json!({ "FROM_SESSION": "s1", "CYNODE_TASK_ID": "forged" });
    let t = Instant::now();
    let (code, created) = sv.post("/v1/worker/sessions", &body).await;
    eprintln!("{backend}: create took {:?}", t.elapsed());
    assert_eq!(code, 201, "{created}");
    let running = json!({
        "version": 1, "session_id": id, "task_id": task, "workspace_id": task,
        "image": env().image, "status": "running",
        "idle_timeout_seconds": 600, "max_lifetime_seconds": 3600
    });
    assert_eq!(without_times(&created), running);
    if crate::harness::is_engine(backend) {
        assert_eq!(
            session_containers(backend, &id),
            vec![format!("cynode-session-{id}")]
        );
    }
    // A repeat answers the same session, 200.
    let (code, again) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!((code, &again), (200, &created));
    let (code, shown) = sv.get(&format!("/v1/worker/sessions/{id}")).await;
    assert_eq!((code, &shown), (200, &created));

    let exec = format!("/v1/worker/sessions/{id}/exec");
    let t = Instant::now();
    let (code, v) = sv
        .post(&exec, &exec_body(&["sh", "-c", "echo hi > f.txt"]))
        .await;
    eprintln!("{backend}: exec took {:?}", t.elapsed());
    assert_eq!(code, 200, "{v}");
    assert_eq!(outcome(&v), ok(""), "{v}");
    assert_eq!(v["session_id"], json!(id));
    let (_, v) = sv.post(&exec, &exec_body(&["cat", "f.txt"])).await;
    assert_eq!(outcome(&v), ok("hi\n"), "{v}");
    // The file is in the task's workspace on the host, owned by the workspace's own host
    // uid (from `sandbox_uids`, never uid 1000 of the host).
    let host = sv.state_dir().join("workspaces").join(&task).join("f.txt");
    assert_eq!(std::fs::read_to_string(&host).unwrap(), "hi\n");
    use std::os::unix::fs::MetadataExt;
    let ws_uid = std::fs::metadata(host.parent().unwrap()).unwrap().uid();
    assert_eq!(std::fs::metadata(&host).unwrap().uid(), ws_uid);
    assert!(ws_uid >= 0x7000_0000, "not from sandbox_uids: {ws_uid}");
    // Inside: uid 1000 under bwrap (its user namespace maps it) and in the microVM's guest
    // (its share is idmapped), the host uid otherwise.
    let inside = if matches!(backend, "bwrap" | "microvm") {
        1000
    } else {
        ws_uid
    };
    // Env: the session's, the exec's over it, the node's over both.
    let mut body = exec_body(&[
        "sh",
        "-c",
        "echo $FROM_SESSION $FROM_EXEC $CYNODE_TASK_ID $CYNODE_SESSION_ID $(id -u) $(pwd)",
    ]);
    body["env"] = json!({ "FROM_EXEC": "e1", "CYNODE_SESSION_ID": "forged" });
    let (_, v) = sv.post(&exec, &body).await;
    assert_eq!(
        outcome(&v),
        ok(&format!("s1 e1 {task} {id} {inside} /workspace\n")),
        "{v}"
    );
    // A failing command is `failed` with its exit code; the session goes on.
    let (_, v) = sv.post(&exec, &exec_body(&["sh", "-c", "exit 3"])).await;
    assert_eq!(
        (v["status"].clone(), v["exit_code"].clone()),
        (json!("failed"), json!(3)),
        "{v}"
    );

    let end = format!("/v1/worker/sessions/{id}/end");
    let t = Instant::now();
    let (code, ended) = sv.post(&end, &json!({})).await;
    eprintln!("{backend}: end took {:?}", t.elapsed());
    assert_eq!(code, 200, "{ended}");
    let mut expected = running.clone();
    expected["status"] = json!("ended");
    expected["end_reason"] = json!("requested");
    assert_eq!(without_times(&ended), expected);
    assert_no_container(&sv, &id);
    // Ending again is idempotent; exec and create after the end are refused.
    let (code, again) = sv.post(&end, &json!({})).await;
    assert_eq!((code, &again), (200, &ended));
    let (code, v) = sv.post(&exec, &exec_body(&["true"])).await;
    assert_eq!(code, 409, "{v}");
    assert_eq!(v["type"], "urn:cynodeai:error:conflict", "{v}");
    assert_eq!(
        v["detail"],
        json!(format!("session {id} has ended (requested)"))
    );
    let (code, _) = sv
        .post("/v1/worker/sessions", &create_body(&id, &task))
        .await;
    assert_eq!(code, 409);
    // The workspace outlives the session.
    assert!(host.exists());
    // Unknown sessions are 404.
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{}/exec", unique("nope")),
            &exec_body(&["true"]),
        )
        .await;
    assert_eq!(code, 404);
    assert_eq!(v["type"], "urn:cynodeai:error:not_found", "{v}");
}

/// Polls the session until its status is `ended` (bounded).
async fn wait_ended(sv: &Server, id: &str, limit: Duration) -> Value {
    let until = Instant::now() + limit;
    loop {
        let (_, v) = sv.get(&format!("/v1/worker/sessions/{id}")).await;
        if v["status"] == "ended" {
            return v;
        }
        assert!(
            Instant::now() < until,
            "session {id} never ended; last: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub async fn idle_timeout_ends_the_session(backend: &'static str) {
    let sv = Server::start(backend, "");
    let Created { id, _cleanup, .. } =
        create_session(&sv, |b| b["idle_timeout_seconds"] = json!(2)).await;
    // A command longer than the idle timeout: the session is not idle while it runs.
    let (_, v) = sv
        .post(
            &format!("/v1/worker/sessions/{id}/exec"),
            &exec_body(&["sleep", "3"]),
        )
        .await;
    assert_eq!(v["status"], "completed", "{v}");
    let t = Instant::now();
    let ended = wait_ended(&sv, &id, Duration::from_secs(20)).await;
    eprintln!("{backend}: reaped {:?} after the last exec", t.elapsed());
    // Idle means 2 s without a command, and the reaper looks every second.
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(ended["end_reason"], "idle_timeout", "{ended}");
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{id}/exec"),
            &exec_body(&["true"]),
        )
        .await;
    assert_eq!(code, 409, "{v}");
    // The reaper removes the container right after marking the session ended.
    if crate::harness::is_engine(backend) {
        let until = Instant::now() + Duration::from_secs(10);
        while !session_containers(backend, &id).is_empty() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_no_container(&sv, &id);
}

pub async fn exec_timeout_kills_the_command_and_the_session_lives_on(backend: &'static str) {
    let sv = Server::start(backend, "");
    let Created {
        id, exec, _cleanup, ..
    } = create_session(&sv, |_| {}).await;
    // A foreground sleep, plus a detached one that clears its environment: both die.
    let (fg, bg) = (marker(), marker());
    let mut body = exec_body(&[
        "sh",
        "-c",
        &format!("(env -i setsid sleep {bg} &); echo started; sleep {fg}"),
    ]);
    body["timeout_seconds"] = json!(1);
    let t = Instant::now();
    let (code, v) = sv.post(&exec, &body).await;
    let took = t.elapsed();
    eprintln!("{backend}: timed-out exec returned after {took:?}");
    assert_eq!(code, 200, "{v}");
    // The sleep is of a marker's length (days): an answer within half a minute is the
    // kill, not the command's end (gVisor's kill under a loaded machine took 6.1 s once).
    assert!(took < Duration::from_secs(30), "{took:?}");
    assert_eq!(
        (
            v["status"].clone(),
            v["exit_code"].clone(),
            v["failure_reason"].clone()
        ),
        (
            json!("timeout"),
            json!(-1),
            json!("command killed after its timeout of 1s")
        ),
        "{v}"
    );
    assert_eq!(v["stdout"], "started\n", "{v}");
    assert!(!process_with_arg(&fg), "the timed-out command survived");
    assert!(!process_with_arg(&bg), "a detached child survived");
    // The session still works.
    let (_, v) = sv.post(&exec, &exec_body(&["echo", "alive"])).await;
    assert_eq!(outcome(&v), ok("alive\n"), "{v}");
    let (_, v) = sv.get(&format!("/v1/worker/sessions/{id}")).await;
    assert_eq!(v["status"], "running", "{v}");
    let (code, _) = sv
        .post(&format!("/v1/worker/sessions/{id}/end"), &json!({}))
        .await;
    assert_eq!(code, 200);
    assert_no_container(&sv, &id);
}

pub async fn max_lifetime_ends_a_running_command(backend: &'static str) {
    let sv = Server::start(backend, "");
    let Created {
        id,
        info: v,
        _cleanup,
        ..
    } = create_session(&sv, |b| b["max_lifetime_seconds"] = json!(2)).await;
    // The idle timeout is capped by the lifetime.
    assert_eq!(
        (
            v["idle_timeout_seconds"].clone(),
            v["max_lifetime_seconds"].clone()
        ),
        (json!(2), json!(2))
    );
    let m = marker();
    let t = Instant::now();
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{id}/exec"),
            &exec_body(&["sh", "-c", &format!("sleep {m}")]),
        )
        .await;
    eprintln!(
        "{backend}: lifetime ended the command after {:?}",
        t.elapsed()
    );
    assert_eq!(code, 200, "{v}");
    // The exec client may wait up to 10 s for podman to notice the removed container under
    // load; anything far below the command's own sleep shows the lifetime ended it.
    assert!(t.elapsed() < Duration::from_secs(25), "{:?}", t.elapsed());
    assert_eq!(
        (
            v["status"].clone(),
            v["exit_code"].clone(),
            v["failure_reason"].clone()
        ),
        (
            json!("failed"),
            json!(-1),
            json!("the session ended while the command ran")
        ),
        "{v}"
    );
    let (_, v) = sv.get(&format!("/v1/worker/sessions/{id}")).await;
    assert_eq!(
        (v["status"].clone(), v["end_reason"].clone()),
        (json!("ended"), json!("max_lifetime")),
        "{v}"
    );
    let until = Instant::now() + Duration::from_secs(10);
    while process_with_arg(&m) && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!process_with_arg(&m), "the command survived its session");
    if crate::harness::is_engine(backend) {
        let until = Instant::now() + Duration::from_secs(10);
        while !session_containers(backend, &id).is_empty() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_no_container(&sv, &id);
}

pub async fn one_command_at_a_time(backend: &'static str) {
    let sv = Arc::new(Server::start(backend, ""));
    let Created {
        id, exec, _cleanup, ..
    } = create_session(&sv, |_| {}).await;
    let m = marker();
    let long = {
        let (sv, exec) = (Arc::clone(&sv), exec.clone());
        let mut body = exec_body(&["sh", "-c", &format!("sleep {m}")]);
        body["timeout_seconds"] = json!(3);
        tokio::spawn(async move { sv.post(&exec, &body).await })
    };
    let until = Instant::now() + Duration::from_secs(20);
    while !process_with_arg(&m) {
        assert!(Instant::now() < until, "the long command never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (code, v) = sv.post(&exec, &exec_body(&["true"])).await;
    assert_eq!(
        (code, v["detail"].clone()),
        (
            409,
            json!(format!("session {id} is running another command"))
        ),
        "{v}"
    );
    let (code, v) = long.await.unwrap();
    assert_eq!((code, v["status"].clone()), (200, json!("timeout")), "{v}");
    let (_, v) = sv.post(&exec, &exec_body(&["echo", "next"])).await;
    assert_eq!(outcome(&v), ok("next\n"), "{v}");
    sv.post(&format!("/v1/worker/sessions/{id}/end"), &json!({}))
        .await;
    assert_no_container(&sv, &id);
}

/// A command that leaves a process running in the background (it ignores SIGTERM) does
/// not outlive its session: once the session ends, no host process of the sandbox is left
/// (for an engine, none that names its container: conmon, the shim, gVisor's sandbox)
/// and no container. On Docker it survived while the node's `docker rm` was refused.
pub async fn background_process_ends_with_the_session(backend: &'static str) {
    let sv = Server::start(backend, "");
    let Created {
        id, exec, _cleanup, ..
    } = create_session(&sv, |_| {}).await;
    let container = crate::harness::container_id(backend, &format!("cynode-session-{id}"));
    let m = marker();
    let script = format!("trap '' TERM INT HUP; sleep {m} >/dev/null 2>&1 &");
    let (code, v) = sv.post(&exec, &exec_body(&["sh", "-c", &script])).await;
    assert_eq!(outcome(&v), ok(""), "{v}");
    assert_eq!(code, 200);
    let (code, v) = sv
        .post(&format!("/v1/worker/sessions/{id}/end"), &json!({}))
        .await;
    assert_eq!(code, 200, "{v}");
    assert!(
        no_process_within(&m, Duration::from_secs(15)).await,
        "the background process survived its session"
    );
    if let Some(cid) = container {
        assert!(
            no_process_within(&cid, Duration::from_secs(15)).await,
            "a host process of container {cid} survived its session"
        );
    }
    assert_no_container(&sv, &id);
}

/// Whether no process has `needle` in its command line, or none has any more within `limit`.
async fn no_process_within(needle: &str, limit: Duration) -> bool {
    let until = Instant::now() + limit;
    while process_with_arg(needle) && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    !process_with_arg(needle)
}

/// A command that kills every process it can: in a container that includes the keep-alive
/// `sleep`, so the container stops and the reaper ends the session; a bubblewrap command
/// only reaches its own sandbox, so the session goes on.
/// A command that kills every process it can leaves the session alive where the
/// container's PID 1 is the pool waiter (Podman, Docker: the waiter runs as the session's
/// uid, but as the namespace's init it takes no signal from inside) and on the per-command
/// backends; under gVisor it kills the keep-alive `sleep`, which ends the session. Killed
/// from outside, the container ends its session on every engine.
pub async fn a_command_cannot_end_its_container_and_its_death_ends_the_session(
    backend: &'static str,
) {
    let sv = Server::start(backend, "");
    let Created {
        id, exec, _cleanup, ..
    } = create_session(&sv, |_| {}).await;
    let (code, v) = sv
        .post(&exec, &exec_body(&["sh", "-c", "kill -9 -1; true"]))
        .await;
    assert_eq!(code, 200, "{v}");
    let keepalive = backend.starts_with("runsc");
    if !keepalive {
        let (_, v) = sv.post(&exec, &exec_body(&["echo", "still"])).await;
        assert_eq!(outcome(&v), ok("still\n"), "{v}");
    }
    if let (Some(cli), false) = (crate::harness::engine_cli(backend), keepalive) {
        let out = std::process::Command::new(cli)
            .args(["kill", &format!("cynode-session-{id}")])
            .output()
            .unwrap();
        assert!(out.status.success(), "{cli} kill: {out:?}");
    }
    if crate::harness::is_engine(backend) {
        let ended = wait_ended(&sv, &id, Duration::from_secs(20)).await;
        assert_eq!(ended["end_reason"], "sandbox_exited", "{ended}");
        let (code, _) = sv.post(&exec, &exec_body(&["true"])).await;
        assert_eq!(code, 409);
        let until = Instant::now() + Duration::from_secs(10);
        while !session_containers(backend, &id).is_empty() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_no_container(&sv, &id);
    }
}

pub async fn auth_is_required(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("s");
    let paths = [
        ("/v1/worker/sessions".to_string(), create_body(&id, "t")),
        (
            format!("/v1/worker/sessions/{id}/exec"),
            exec_body(&["true"]),
        ),
        (format!("/v1/worker/sessions/{id}/end"), json!({})),
    ];
    for (path, body) in &paths {
        for token in [None, Some(format!("{TOKEN}x"))] {
            let mut r = sv.client.post(sv.url(path)).json(body);
            if let Some(t) = &token {
                r = r.bearer_auth(t);
            }
            let r = r.send().await.unwrap();
            assert_eq!(r.status().as_u16(), 401, "{path} {token:?}");
            assert_eq!(r.headers()["content-type"], "application/problem+json");
        }
    }
    let r = sv
        .client
        .get(sv.url(&format!("/v1/worker/sessions/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    // Nothing was created by the refused calls.
    let (code, _) = sv.get(&format!("/v1/worker/sessions/{id}")).await;
    assert_eq!(code, 404);
    assert_no_container(&sv, &id);
}

pub async fn invalid_requests_name_the_field(backend: &'static str) {
    let sv = Server::start(backend, "images: [\"localhost/cynode-sba-test:latest\"]\n");
    let id = unique("s");
    let _cleanup = session_guard(sv.backend, &id);
    let mut body = create_body(&id, "t");
    body["surprise"] = json!(1);
    let (code, v) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["type"], "urn:cynodeai:error:validation");
    assert_field_starts(&v, "detail", "surprise: unknown field");
    let mut body = create_body(&id, "t");
    body["image"] = json!("localhost/elsewhere:latest");
    let (code, v) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 400, "{v}");
    assert_eq!(
        v["detail"],
        "image: image `localhost/elsewhere:latest` is not in this node's image allowlist"
    );
    let mut body = create_body(&id, "t");
    body["max_lifetime_seconds"] = json!(0);
    let (code, v) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(
        (code, v["detail"].clone()),
        (400, json!("max_lifetime_seconds: must be positive"))
    );
    let (code, v) = sv
        .post("/v1/worker/sessions", &create_body("../../etc", "t"))
        .await;
    assert_eq!(code, 400, "{v}");
    assert!(
        v["detail"].as_str().unwrap().starts_with("session_id: "),
        "{v}"
    );
    // Nothing was created by the rejected calls.
    let (code, _) = sv.get(&format!("/v1/worker/sessions/{id}")).await;
    assert_eq!(code, 404);
    assert_no_container(&sv, &id);

    let (code, _) = sv.post("/v1/worker/sessions", &create_body(&id, "t")).await;
    assert_eq!(code, 201);
    let exec = format!("/v1/worker/sessions/{id}/exec");
    let mut body = exec_body(&["true"]);
    body["cwd"] = json!("/");
    let (code, v) = sv.post(&exec, &body).await;
    assert_eq!(code, 400, "{v}");
    assert_field_starts(&v, "detail", "cwd: unknown field");
    let (code, v) = sv.post(&exec, &exec_body(&[])).await;
    assert_eq!(
        (code, v["detail"].clone()),
        (400, json!("command: must not be empty"))
    );
    let (code, _) = sv
        .post(&format!("/v1/worker/sessions/{id}/end"), &json!({}))
        .await;
    assert_eq!(code, 200);
    assert_no_container(&sv, &id);
}
