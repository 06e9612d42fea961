//! The stdin and signals of streamed session execs on the real server, once per backend.
//! Attacks first: another session's exec, a guessed id, no token, a signal outside the
//! allow-list, a huge body (413, nothing written), a write or signal to an ended exec
//! (409, at once), a command that never reads (409 `stdin_blocked`, bounded). Then: `cat`
//! echoes what is written and ends at close; TERM ends `sleep 60` and the wait reports it;
//! INT reaches a `trap` in a script. The microVM refuses both by name.

use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};

use crate::harness::{answer, Server, TOKEN};
use crate::session_files::Session;
use crate::session_streams::{exec_path, output, read_events, wait};

on_both_backends!(
    session_stdin:
    stdin_and_signals_reach_only_their_own_exec,
    a_huge_stdin_is_refused_and_nothing_of_it_written,
    an_ended_exec_refuses_stdin_and_signals_at_once,
    a_command_that_never_reads_blocks_a_write_for_a_bounded_time,
    cat_echoes_its_stdin_and_ends_at_close,
    term_ends_a_sleep_and_the_wait_reports_it,
    int_reaches_a_trap_in_a_script,
    signals_sent_at_once_all_arrive_and_the_session_lives_on,
);

/// Starts `script` streamed, with a stdin when `stdin`; answers the exec id.
async fn start(sv: &Server, s: &Session, script: &str, stdin: bool) -> String {
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{}/exec", s.id),
            &json!({ "version": 1, "command": ["sh", "-c", script], "stream": true, "stdin": stdin }),
        )
        .await;
    assert_eq!(code, 202, "{v}");
    v["exec_id"].as_str().unwrap().to_string()
}

/// `POST …/stdin[?close=true]` with `body` (and the token unless `token` is false).
async fn write(sv: &Server, path: &str, body: Vec<u8>, close: bool, token: bool) -> (u16, Value) {
    let q = if close { "?close=true" } else { "" };
    let mut r = sv
        .client
        .post(sv.url(&format!("{path}/stdin{q}")))
        .header("content-type", "application/octet-stream")
        .body(body)
        .timeout(Duration::from_secs(120));
    if token {
        r = r.bearer_auth(TOKEN);
    }
    answer(r.send().await.unwrap()).await
}

/// `POST …:signal` with `body`.
async fn signal_raw(sv: &Server, path: &str, body: &Value, token: bool) -> (u16, Value) {
    let mut r = sv
        .client
        .post(sv.url(&format!("{path}:signal")))
        .json(body)
        .timeout(Duration::from_secs(120));
    if token {
        r = r.bearer_auth(TOKEN);
    }
    answer(r.send().await.unwrap()).await
}

async fn signal(sv: &Server, path: &str, name: &str) -> (u16, Value) {
    signal_raw(sv, path, &json!({ "signal": name }), true).await
}

/// The detail of a problem answer.
fn detail(v: &Value) -> String {
    v["detail"].as_str().unwrap_or_default().to_string()
}

/// Everything the exec wrote to stdout, read to its exit.
async fn stdout_of(sv: &Server, s: &Session, id: &str) -> Vec<u8> {
    let mut r = output(sv, s, id, None).await;
    let mut out = Vec::new();
    for e in read_events(&mut r, usize::MAX).await {
        if e.kind == "stdout" {
            out.extend(
                base64::engine::general_purpose::STANDARD
                    .decode(e.data["data"].as_str().unwrap())
                    .unwrap(),
            );
        }
    }
    out
}

/// Waits (bounded) until the exec wrote at least `n` bytes to stdout.
async fn until_written(sv: &Server, s: &Session, id: &str, n: u64) {
    for _ in 0..600 {
        let (code, v) = sv.get(&exec_path(s, id)).await;
        assert_eq!(code, 200, "{v}");
        if v["stdout_bytes"].as_u64().unwrap() >= n {
            return;
        }
        assert_eq!(v["running"], json!(true), "ended early: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("exec {id} never wrote {n} bytes");
}

pub async fn stdin_and_signals_reach_only_their_own_exec(backend: &'static str) {
    let sv = Server::start(backend, "");
    let a = Session::start(&sv).await;
    let b = Session::start(&sv).await;
    let id = start(&sv, &a, "cat", true).await;
    let guessed = "0123456789abcdef0123456789abcdef";
    // Another session's exec, a guessed id, an unknown session: not found.
    for path in [
        exec_path(&b, &id),
        exec_path(&a, guessed),
        format!("/v1/worker/sessions/no-such-session/execs/{id}"),
    ] {
        let (code, v) = write(&sv, &path, b"intruder\n".to_vec(), true, true).await;
        assert_eq!(code, 404, "{path}: {v}");
        let (code, v) = signal(&sv, &path, "KILL").await;
        assert_eq!(code, 404, "{path}: {v}");
    }
    // Without the token: 401.
    let mine = exec_path(&a, &id);
    let (code, _) = write(&sv, &mine, b"intruder\n".to_vec(), true, false).await;
    assert_eq!(code, 401);
    let (code, _) = signal_raw(&sv, &mine, &json!({ "signal": "KILL" }), false).await;
    assert_eq!(code, 401);
    // Signals outside the allow-list, and bodies that are no signal request: 400 naming
    // the field.
    for name in ["STOP", "CONT", "SIGTERM", "term", "9", "", "TERM\n", "SEGV"] {
        let (code, v) = signal(&sv, &mine, name).await;
        assert_eq!(code, 400, "{name:?}: {v}");
        assert!(detail(&v).starts_with("signal:"), "{v}");
    }
    for body in [
        json!({}),
        json!({ "signal": 15 }),
        json!({ "signal": "TERM", "pid": 1 }),
    ] {
        let (code, v) = signal_raw(&sv, &mine, &body, true).await;
        assert_eq!(code, 400, "{body}: {v}");
        assert!(detail(&v).starts_with("signal:"), "{v}");
    }
    let (code, v) = sv.post(&format!("{mine}:stop"), &json!({})).await;
    assert_eq!(code, 404, "{v}");
    // The exec got none of it: it is running, and ends with empty output at its close.
    let (code, v) = write(&sv, &mine, Vec::new(), true, true).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        (v["bytes"].clone(), v["closed"].clone()),
        (json!(0), json!(true))
    );
    let v = wait(&sv, &a, &id, 60_000).await;
    assert_eq!(v["result"]["exit_code"], json!(0), "{v}");
    assert_eq!(stdout_of(&sv, &a, &id).await, b"");
    // An exec started without a stdin takes none; a plain exec cannot ask for one.
    let id = start(&sv, &a, "cat; echo end", false).await;
    let (code, v) = write(&sv, &exec_path(&a, &id), b"x".to_vec(), false, true).await;
    assert_eq!(code, 409, "{v}");
    assert!(detail(&v).starts_with("stdin_not_open"), "{v}");
    let v = wait(&sv, &a, &id, 60_000).await;
    assert_eq!(v["result"]["exit_code"], json!(0), "{v}");
    assert_eq!(stdout_of(&sv, &a, &id).await, b"end\n");
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{}/exec", a.id),
            &json!({ "version": 1, "command": ["cat"], "stdin": true }),
        )
        .await;
    assert_eq!(code, 400, "{v}");
}

pub async fn a_huge_stdin_is_refused_and_nothing_of_it_written(backend: &'static str) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    let id = start(&sv, &s, "wc -c", true).await;
    let path = exec_path(&s, &id);
    let max = 1024 * 1024;
    // Declared too long: refused before it is read.
    let (code, v) = write(&sv, &path, vec![b'a'; max + 1], false, true).await;
    assert_eq!(code, 413, "{v}");
    // Too long without a declared length (a chunked body): refused as it is read.
    let url = reqwest::Url::parse(&sv.url(&format!("{path}/stdin"))).unwrap();
    let (addr, target) = (
        format!("{}:{}", url.host_str().unwrap(), url.port().unwrap()),
        url.path().to_string(),
    );
    let status = tokio::task::spawn_blocking(move || chunked_status(&addr, &target, 40))
        .await
        .unwrap();
    assert_eq!(status, 413);
    // Exactly the bound is taken, and nothing of the refused bodies was written.
    let (code, v) = write(&sv, &path, vec![b'c'; max], true, true).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        (v["bytes"].clone(), v["total_bytes"].clone()),
        (json!(max), json!(max))
    );
    let v = wait(&sv, &s, &id, 60_000).await;
    assert_eq!(v["result"]["exit_code"], json!(0), "{v}");
    let out = String::from_utf8(stdout_of(&sv, &s, &id).await).unwrap();
    assert_eq!(out.trim(), max.to_string());
}

/// The status of a chunked `POST target` of `chunks` 64 KiB chunks (the node may answer
/// before all is sent: a failed write is fine).
fn chunked_status(addr: &str, target: &str, chunks: usize) -> u16 {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "POST {target} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    let _ = c.write_all(head.as_bytes());
    let chunk = [b'b'; 65536];
    for _ in 0..chunks {
        if c.write_all(b"10000\r\n").is_err()
            || c.write_all(&chunk).is_err()
            || c.write_all(b"\r\n").is_err()
        {
            break;
        }
    }
    let _ = c.write_all(b"0\r\n\r\n");
    let mut text = Vec::new();
    let _ = c.read_to_end(&mut text);
    crate::harness::status_and_body(&String::from_utf8_lossy(&text)).0
}

pub async fn an_ended_exec_refuses_stdin_and_signals_at_once(backend: &'static str) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    let id = start(&sv, &s, "exit 4", true).await;
    let v = wait(&sv, &s, &id, 60_000).await;
    assert_eq!(v["result"]["exit_code"], json!(4), "{v}");
    let path = exec_path(&s, &id);
    // Named 409s (not the 10 s `stdin_blocked` bound, not a hang).
    let (code, v) = write(&sv, &path, b"late\n".to_vec(), false, true).await;
    assert_eq!(code, 409, "{v}");
    assert!(detail(&v).starts_with("exec_ended"), "{v}");
    let (code, v) = write(&sv, &path, Vec::new(), true, true).await;
    assert_eq!(code, 409, "{v}");
    assert!(detail(&v).starts_with("exec_ended"), "{v}");
    for name in ["TERM", "KILL"] {
        let (code, v) = signal(&sv, &path, name).await;
        assert_eq!(code, 409, "{v}");
        assert!(detail(&v).starts_with("exec_ended"), "{v}");
    }
    // A closed stdin takes nothing more either.
    let id = start(&sv, &s, "cat >/dev/null; sleep 60", true).await;
    let path = exec_path(&s, &id);
    let (code, v) = write(&sv, &path, b"one\n".to_vec(), true, true).await;
    assert_eq!(code, 200, "{v}");
    let (code, v) = write(&sv, &path, b"two\n".to_vec(), false, true).await;
    assert_eq!(code, 409, "{v}");
    assert!(detail(&v).starts_with("exec_ended"), "{v}");
    let (code, v) = signal(&sv, &path, "KILL").await;
    let (_, state) = sv.get(&path).await;
    assert_eq!(code, 200, "{v} {state}");
    let v = wait(&sv, &s, &id, 60_000).await;
    assert_eq!(v["result"]["exit_code"], json!(137), "{v}");
    assert!(
        v["result"]["failure_reason"]
            .as_str()
            .unwrap_or_default()
            .contains("SIGKILL, sent through"),
        "{v}"
    );
}

pub async fn a_command_that_never_reads_blocks_a_write_for_a_bounded_time(backend: &'static str) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    let id = start(&sv, &s, "echo ready; exec sleep 60", true).await;
    until_written(&sv, &s, &id, 6).await;
    let path = exec_path(&s, &id);
    // The pipe holds a little; then a write waits for the command, up to the bound.
    let mut blocked = None;
    for _ in 0..64 {
        let (code, v) = write(&sv, &path, vec![b'z'; 1024 * 1024], false, true).await;
        if code != 200 {
            blocked = Some((code, v));
            break;
        }
    }
    let (code, v) = blocked.expect("1 MiB writes never blocked");
    assert_eq!(code, 409, "{v}");
    assert!(detail(&v).starts_with("stdin_blocked"), "{v}");
    // The command is still there to be ended.
    let (code, v) = signal(&sv, &path, "TERM").await;
    assert_eq!(code, 200, "{v}");
    let v = wait(&sv, &s, &id, 60_000).await;
    assert_eq!(v["result"]["exit_code"], json!(143), "{v}");
}

pub async fn cat_echoes_its_stdin_and_ends_at_close(backend: &'static str) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    let id = start(&sv, &s, "cat; echo closed", true).await;
    let path = exec_path(&s, &id);
    let mut expected = Vec::new();
    for part in [
        b"hello\n".to_vec(),
        (0u8..=255).collect::<Vec<u8>>(),
        b"world\n".to_vec(),
    ] {
        let (code, v) = write(&sv, &path, part.clone(), false, true).await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["closed"], json!(false));
        expected.extend(part);
    }
    // Still running until the close.
    let (_, v) = sv.get(&path).await;
    assert_eq!(v["running"], json!(true), "{v}");
    let (code, v) = write(&sv, &path, b"last\n".to_vec(), true, true).await;
    assert_eq!(code, 200, "{v}");
    expected.extend(b"last\n");
    assert_eq!(
        (v["closed"].clone(), v["total_bytes"].clone()),
        (json!(true), json!(expected.len()))
    );
    let v = wait(&sv, &s, &id, 60_000).await;
    assert_eq!(
        (
            v["result"]["exit_code"].clone(),
            v["result"]["status"].clone()
        ),
        (json!(0), json!("completed")),
        "{v}"
    );
    expected.extend(b"closed\n");
    assert_eq!(stdout_of(&sv, &s, &id).await, expected);
}

pub async fn term_ends_a_sleep_and_the_wait_reports_it(backend: &'static str) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    let id = start(&sv, &s, "echo ready; exec sleep 60", false).await;
    until_written(&sv, &s, &id, 6).await;
    let path = exec_path(&s, &id);
    let (code, v) = signal(&sv, &path, "TERM").await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        (v["signal"].clone(), v["exec_id"].clone()),
        (json!("TERM"), json!(id))
    );
    let v = wait(&sv, &s, &id, 30_000).await;
    assert_eq!(
        (
            v["running"].clone(),
            v["result"]["exit_code"].clone(),
            v["result"]["status"].clone(),
            v["result"]["failure_reason"].clone()
        ),
        (
            json!(false),
            json!(143),
            json!("failed"),
            json!("command ended by SIGTERM, sent through the exec's :signal")
        ),
        "{v}"
    );
    // The session runs the next command as before.
    assert_eq!(s.sh(&sv, "echo next").await, (0, "next\n".to_string()));
}

/// Two signals sent at the same moment both reach the command (on Podman and Docker they
/// are two messages to the session's waiter, which may find them queued together), and
/// the session runs its next command.
pub async fn signals_sent_at_once_all_arrive_and_the_session_lives_on(backend: &'static str) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    let script = "trap 'echo got-usr1' USR1; trap 'echo got-usr2' USR2; echo ready; \
                  while :; do sleep 0.1; done";
    let id = start(&sv, &s, script, false).await;
    until_written(&sv, &s, &id, 6).await;
    let path = exec_path(&s, &id);
    let (one, two) = tokio::join!(signal(&sv, &path, "USR1"), signal(&sv, &path, "USR2"));
    assert_eq!((one.0, two.0), (200, 200), "{one:?} {two:?}");
    until_written(&sv, &s, &id, 6 + 9 + 9).await;
    let (code, v) = signal(&sv, &path, "KILL").await;
    assert_eq!(code, 200, "{v}");
    let v = wait(&sv, &s, &id, 30_000).await;
    assert_eq!(v["result"]["exit_code"], json!(137), "{v}");
    let out = String::from_utf8_lossy(&stdout_of(&sv, &s, &id).await).into_owned();
    assert!(
        out.contains("got-usr1\n") && out.contains("got-usr2\n"),
        "{out:?}"
    );
    assert_eq!(s.sh(&sv, "echo next").await, (0, "next\n".to_string()));
}

pub async fn int_reaches_a_trap_in_a_script(backend: &'static str) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    let script =
        "trap 'echo got-int; exit 5' INT; echo ready; sleep 60 >/dev/null 2>&1 & wait; echo no-int";
    let id = start(&sv, &s, script, false).await;
    until_written(&sv, &s, &id, 6).await;
    let (code, v) = signal(&sv, &exec_path(&s, &id), "INT").await;
    assert_eq!(code, 200, "{v}");
    let v = wait(&sv, &s, &id, 30_000).await;
    assert_eq!(v["result"]["exit_code"], json!(5), "{v}");
    assert_eq!(stdout_of(&sv, &s, &id).await, b"ready\ngot-int\n");
}

/// The microVM gives a command neither a stdin nor signals: both refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_microvm_refuses_stdin_and_signals_by_name() {
    crate::cases::setup_for("microvm");
    let sv = Server::start("microvm", "");
    let s = Session::start(&sv).await;
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{}/exec", s.id),
            &json!({ "version": 1, "command": ["cat"], "stream": true, "stdin": true }),
        )
        .await;
    assert_eq!(code, 400, "{v}");
    assert!(detail(&v).starts_with("stdin: stdin_unsupported"), "{v}");
    let id = start(&sv, &s, "echo ready; sleep 5", false).await;
    let (code, v) = signal(&sv, &exec_path(&s, &id), "TERM").await;
    assert_eq!(code, 409, "{v}");
    assert!(detail(&v).starts_with("signal_unsupported"), "{v}");
    let v = wait(&sv, &s, &id, 60_000).await;
    assert_eq!(v["result"]["exit_code"], json!(0), "{v}");
}
