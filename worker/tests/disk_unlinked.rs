//! A file unlinked while still open: its blocks stay allocated while a
//! process holds it, though no walk of the tree can see it. The disk guard counts the
//! open descriptors of the sandbox's processes, so it is a breach like a linked file. On
//! both backends, for a job and for a session command.

use serde_json::json;

use crate::harness::{command_job, env, session_guard, unique, Server};

on_both_backends!(disk_unlinked: disk_unlinked_open_file_is_counted);

/// The session case on the backends whose sandbox processes are host processes of the
/// workspace's uid. Not gVisor (runsc): its sentry holds a session command's files, and
/// the scan does not see them there (kernel-enforced volumes do).
macro_rules! session_case {
    ($($backend:ident),*) => {$(
        mod $backend {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn disk_unlinked_open_file_of_a_session_command_is_counted() {
                crate::cases::setup();
                crate::disk_unlinked::disk_unlinked_open_file_of_a_session_command_is_counted(
                    stringify!($backend),
                )
                .await;
            }
        }
    )*};
}
mod session {
    session_case!(bwrap, podman, docker);
}

/// Opens /workspace/big, unlinks it, writes 200 MiB through the descriptor and holds it.
const SCRIPT: &str = "exec 3>/workspace/big || exit 9; rm /workspace/big || exit 9; \
     dd if=/dev/zero bs=1048576 count=200 >&3 2>/dev/null; echo written; sleep 30; echo slept";

fn over_the_limit(backend: &str, v: &serde_json::Value) {
    eprintln!("{backend}: {}", v["failure_reason"]);
    assert_eq!(v["status"], "failed", "{backend}: {v}");
    assert!(
        v["failure_reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("resource_limit_exceeded")),
        "{backend}: {v}"
    );
    assert!(
        !v["stdout"].as_str().unwrap_or_default().contains("slept"),
        "{backend}: the job ran to its end: {v}"
    );
}

/// A job writing 200 MiB into a file it unlinked, under `disk_mb: 48`, fails
/// `resource_limit_exceeded` while it still holds the file.
pub async fn disk_unlinked_open_file_is_counted(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  disk_mb: 48\n");
    let mut body = command_job(&unique("j"), &unique("t"), &["sh", "-c", SCRIPT]);
    body["sandbox"]["timeout_seconds"] = json!(120);
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 200, "{v}");
    over_the_limit(backend, &v);
}

/// The same from a session command.
pub async fn disk_unlinked_open_file_of_a_session_command_is_counted(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  disk_mb: 48\n");
    let sid = unique("s");
    let _guard = session_guard(backend, &sid);
    let body =
        json!({ "version": 1, "session_id": sid, "task_id": unique("t"), "image": env().image });
    let (code, v) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 201, "{v}");
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{sid}/exec"),
            &json!({ "version": 1, "command": ["sh", "-c", SCRIPT] }),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    over_the_limit(backend, &v);
}
