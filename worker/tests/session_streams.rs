//! Streamed session execs on the real server, once per backend: exec ids that are guessed
//! or belong to another session are not found; output past the ring is named as cut; a
//! reader that drops mid-way and comes back from its last event id gets every byte the
//! node kept, exactly once; a flood does not grow the node's memory past its bound; the
//! wait gives the exit code.

use std::collections::BTreeMap;

use base64::Engine;
use serde_json::{json, Value};

use crate::harness::{Server, TOKEN};
use crate::session_files::Session;

on_both_backends!(
    session_streams:
    exec_ids_are_scoped_to_their_session_and_unguessable,
    a_dropped_reader_reattaches_and_loses_nothing_kept,
    a_flood_stays_within_the_ring,
    the_wait_gives_the_exit_code,
);

// On the microVM (each command a VM of its own under TCG here): the cases that show its
// sessions keep their promises, not every one again.
on_both_backends!(@one session_streams microvm [
    a_dropped_reader_reattaches_and_loses_nothing_kept,
    the_wait_gives_the_exit_code
]);

/// One server-sent event.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub kind: String,
    pub id: String,
    pub data: Value,
}

/// Reads events from an output response; stops after `max` events, or at the end.
pub(crate) async fn read_events(r: &mut reqwest::Response, max: usize) -> Vec<Event> {
    let mut buf = Vec::new();
    let mut events = Vec::new();
    while events.len() < max {
        while let Some(end) = find(&buf, b"\n\n") {
            let block: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8(block).unwrap();
            let mut e = Event {
                kind: String::new(),
                id: String::new(),
                data: Value::Null,
            };
            for line in text.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    e.kind = v.into();
                } else if let Some(v) = line.strip_prefix("id: ") {
                    e.id = v.into();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    e.data = serde_json::from_str(v).unwrap();
                }
            }
            if !e.kind.is_empty() {
                events.push(e);
                if events.len() == max {
                    return events;
                }
            }
        }
        match r.chunk().await.unwrap() {
            Some(c) => buf.extend_from_slice(&c),
            None => break,
        }
    }
    events
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

async fn start(sv: &Server, s: &Session, script: &str) -> (u16, Value) {
    sv.post(
        &format!("/v1/worker/sessions/{}/exec", s.id),
        &json!({ "version": 1, "command": ["sh", "-c", script], "stream": true }),
    )
    .await
}

async fn started(sv: &Server, s: &Session, script: &str) -> String {
    let (code, v) = start(sv, s, script).await;
    assert_eq!(code, 202, "{v}");
    assert_eq!(v["session_id"], json!(s.id));
    let id = v["exec_id"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 32, "{id}");
    id
}

pub(crate) fn exec_path(s: &Session, exec_id: &str) -> String {
    format!("/v1/worker/sessions/{}/execs/{exec_id}", s.id)
}

pub(crate) async fn wait(sv: &Server, s: &Session, exec_id: &str, timeout_ms: u64) -> Value {
    let (code, v) = sv
        .get(&format!(
            "{}?wait=true&timeout_ms={timeout_ms}",
            exec_path(s, exec_id)
        ))
        .await;
    assert_eq!(code, 200, "{v}");
    v
}

pub(crate) async fn output(
    sv: &Server,
    s: &Session,
    exec_id: &str,
    last_id: Option<&str>,
) -> reqwest::Response {
    let mut r = sv
        .client
        .get(sv.url(&format!("{}/output", exec_path(s, exec_id))))
        .bearer_auth(TOKEN)
        .timeout(std::time::Duration::from_secs(120));
    if let Some(id) = last_id {
        r = r.header("Last-Event-ID", id);
    }
    let r = r.send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    r
}

/// Per stream: the bytes read at their offsets, and the cuts.
#[derive(Default, Debug)]
struct Seen {
    bytes: BTreeMap<(String, u64), Vec<u8>>,
    cuts: Vec<(String, u64, u64)>,
    exit: Option<Value>,
}

impl Seen {
    fn add(&mut self, events: &[Event]) {
        for e in events {
            match e.kind.as_str() {
                "stdout" | "stderr" => {
                    let data = base64::engine::general_purpose::STANDARD
                        .decode(e.data["data"].as_str().unwrap())
                        .unwrap();
                    let at = e.data["offset"].as_u64().unwrap();
                    assert!(
                        self.bytes.insert((e.kind.clone(), at), data).is_none(),
                        "offset {at} of {} read twice",
                        e.kind
                    );
                }
                "cut" => self.cuts.push((
                    e.data["stream"].as_str().unwrap().into(),
                    e.data["from"].as_u64().unwrap(),
                    e.data["to"].as_u64().unwrap(),
                )),
                "exit" => self.exit = Some(e.data.clone()),
                other => panic!("unknown event {other}"),
            }
        }
    }

    /// Checks that the stream's chunks and cuts tile `[0, expected.len())` exactly, each
    /// chunk the expected bytes at its offset; answers the bytes read.
    fn check(&self, name: &str, expected: &[u8]) -> u64 {
        let mut tiles: Vec<(u64, u64, Option<&Vec<u8>>)> = self
            .cuts
            .iter()
            .filter(|c| c.0 == name)
            .map(|c| (c.1, c.2, None))
            .collect();
        for ((n, off), b) in &self.bytes {
            if n == name {
                tiles.push((*off, off + b.len() as u64, Some(b)));
            }
        }
        tiles.sort_by_key(|t| t.0);
        let (mut at, mut read) = (0u64, 0u64);
        for (from, to, bytes) in tiles {
            assert_eq!(from, at, "{name}: a gap or overlap at {at}");
            if let Some(b) = bytes {
                assert_eq!(
                    &b[..],
                    &expected[from as usize..to as usize],
                    "{name} at {from}"
                );
                read += b.len() as u64;
            }
            at = to;
        }
        assert_eq!(at, expected.len() as u64, "{name}: not read to its end");
        read
    }
}

/// `seq 1 n` as the command prints it.
fn seq(n: u32) -> Vec<u8> {
    (1..=n)
        .map(|i| format!("{i}\n"))
        .collect::<String>()
        .into_bytes()
}

pub async fn exec_ids_are_scoped_to_their_session_and_unguessable(backend: &'static str) {
    let sv = Server::start(backend, "");
    let a = Session::start(&sv).await;
    let b = Session::start(&sv).await;
    let id = started(&sv, &a, "echo a").await;
    wait(&sv, &a, &id, 60_000).await;
    // The exec under another session, a guessed id, a malformed id, an unknown session.
    let guessed = "0123456789abcdef0123456789abcdef";
    for path in [
        exec_path(&b, &id),
        format!("{}/output", exec_path(&b, &id)),
        exec_path(&a, guessed),
        format!("{}/output", exec_path(&a, guessed)),
        format!("/v1/worker/sessions/no-such-session/execs/{id}"),
    ] {
        let (code, v) = sv.get(&path).await;
        assert_eq!(code, 404, "{path}: {v}");
    }
    let (code, v) = sv.get(&exec_path(&a, "../../x")).await;
    assert!(code == 400 || code == 404, "{v}");
    // Without the token: 401, whatever the id.
    let r = sv
        .client
        .get(sv.url(&exec_path(&a, &id)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    // Ids do not repeat.
    let other = started(&sv, &a, "true").await;
    assert_ne!(other, id);
}

pub async fn a_dropped_reader_reattaches_and_loses_nothing_kept(backend: &'static str) {
    let ring = 65_536u64;
    let sv = Server::start(
        backend,
        &format!("limits:\n  exec_output_ring_bytes: {ring}\n"),
    );
    let s = Session::start(&sv).await;
    let n = 60_000;
    let expected = seq(n);
    let id = started(&sv, &s, &format!("seq 1 {n}; echo oops >&2; exit 3")).await;
    // A reader from the start: a few events, then it drops.
    let mut seen = Seen::default();
    let mut r = output(&sv, &s, &id, None).await;
    let first = read_events(&mut r, 3).await;
    drop(r);
    seen.add(&first);
    let last_id = first.last().unwrap().id.clone();
    // It comes back from its last event id and reads to the end.
    let mut r = output(&sv, &s, &id, Some(&last_id)).await;
    let rest = read_events(&mut r, usize::MAX).await;
    seen.add(&rest);
    assert_eq!(rest.last().map(|e| e.kind.as_str()), Some("exit"));
    let exit = seen.exit.clone().unwrap();
    assert_eq!(
        (
            exit["running"].clone(),
            exit["stdout_bytes"].clone(),
            exit["result"]["exit_code"].clone(),
            exit["result"]["status"].clone()
        ),
        (
            json!(false),
            json!(expected.len()),
            json!(3),
            json!("failed")
        )
    );
    // Everything kept, once, contiguous; what was not kept is named as cut.
    let read = seen.check("stdout", &expected);
    assert!(read >= ring, "less than the ring was read: {read}");
    assert_eq!(seen.check("stderr", b"oops\n"), 5);
    // Read again from the start after the end: the cut is named, then the kept tail.
    let mut again = Seen::default();
    let mut r = output(&sv, &s, &id, None).await;
    again.add(&read_events(&mut r, usize::MAX).await);
    assert_eq!(
        again.cuts,
        vec![("stdout".to_string(), 0, expected.len() as u64 - ring)]
    );
    assert_eq!(again.check("stdout", &expected), ring);
    // An offset past what was written is refused.
    let (code, v) = sv
        .get(&format!(
            "{}/output?stdout_offset={}",
            exec_path(&s, &id),
            expected.len() + 1
        ))
        .await;
    assert_eq!(code, 400, "{v}");
}

/// A field of /proc/<pid>/status in bytes.
fn status_bytes(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

pub async fn a_flood_stays_within_the_ring(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  exec_output_ring_bytes: 65536\n");
    let s = Session::start(&sv).await;
    let before = status_bytes(sv.pid(), "VmRSS");
    let flood = 512u64 * 1024 * 1024;
    let id = started(&sv, &s, &format!("head -c {flood} /dev/zero")).await;
    let v = wait(&sv, &s, &id, 300_000).await;
    assert_eq!(
        (v["running"].clone(), v["stdout_bytes"].clone()),
        (json!(false), json!(flood)),
        "{v}"
    );
    let after = status_bytes(sv.pid(), "VmHWM");
    assert!(
        after < before + 128 * 1024 * 1024,
        "the node grew from {before} to {after} bytes for a {flood}-byte flood"
    );
}

pub async fn the_wait_gives_the_exit_code(backend: &'static str) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    let id = started(&sv, &s, "exit 7").await;
    let v = wait(&sv, &s, &id, 60_000).await;
    assert_eq!(
        (
            v["running"].clone(),
            v["result"]["exit_code"].clone(),
            v["result"]["status"].clone()
        ),
        (json!(false), json!(7), json!("failed")),
        "{v}"
    );
    // One command at a time, streamed or not.
    let long = started(&sv, &s, "sleep 60").await;
    let (code, v) = start(&sv, &s, "true").await;
    assert_eq!(code, 409, "{v}");
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{}/exec", s.id),
            &json!({ "version": 1, "command": ["true"] }),
        )
        .await;
    assert_eq!(code, 409, "{v}");
    // A wait that runs out answers the exec still running.
    let v = wait(&sv, &s, &long, 100).await;
    assert_eq!(v["running"], json!(true), "{v}");
    // The session's end ends the command; the wait says how.
    let (code, _) = sv
        .post(&format!("/v1/worker/sessions/{}/end", s.id), &json!({}))
        .await;
    assert_eq!(code, 200);
    let v = wait(&sv, &s, &long, 60_000).await;
    assert_eq!(
        (v["running"].clone(), v["result"]["failure_reason"].clone()),
        (
            json!(false),
            json!("the session ended while the command ran")
        ),
        "{v}"
    );
}
