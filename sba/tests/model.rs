//! A scripted OpenAI-compatible server for the agent loop tests: `/v1/models` lists fixed
//! ids, each `/v1/chat/completions` gets the next scripted reply. It records every chat
//! request, and the todo.json on disk at the moment the request arrived. As a relay
//! ([`Model::relay`]) it answers nothing itself: every request goes to a real model server
//! on 127.0.0.1 and its answer comes back unchanged, the chat requests recorded the same way.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

/// One scripted answer to a chat request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// An action: sent as the message content (JSON text).
    Action(Value),
    /// Any content string (for invalid replies).
    Raw(String),
    /// An HTTP error status with a body.
    Status(u16, String),
    /// Wait this long, then answer (a slow model).
    Slow(Duration, Value),
}

/// What the server saw for one chat request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub body: Value,
    pub todo_json: Option<Value>,
}

pub struct Model {
    /// `http://127.0.0.1:PORT` or `http+unix://…`.
    pub url: String,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub models_calls: Arc<Mutex<u32>>,
    _dir: Option<tempfile::TempDir>,
}

struct State {
    models: Vec<String>,
    script: Mutex<Vec<Reply>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    models_calls: Arc<Mutex<u32>>,
    todo_path: Option<PathBuf>,
    /// `127.0.0.1:PORT` of the model server a relay forwards to.
    upstream: Option<String>,
}

/// An action reply: `{"thought", "action": {"type", "arguments"}}`.
pub fn act(ty: &str, arguments: Value) -> Reply {
    Reply::Action(
        json!({ "thought": format!("do {ty}"), "action": { "type": ty, "arguments": arguments } }),
    )
}

pub fn finish(status: &str, answer: &str) -> Reply {
    act(
        "finish",
        json!({ "status": status, "final_answer": answer }),
    )
}

impl Model {
    /// Serves on 127.0.0.1. `todo_path`: the todo.json to snapshot on every chat request.
    pub fn tcp(models: &[&str], script: Vec<Reply>, todo_path: Option<&Path>) -> Model {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        Model::start(
            url,
            None,
            move || l.accept().map(|(s, _)| s),
            models,
            script,
            todo_path,
        )
    }

    /// Serves on a Unix socket; the URL is `http+unix://<percent-encoded path>`.
    pub fn unix(models: &[&str], script: Vec<Reply>, todo_path: Option<&Path>) -> Model {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("inference.sock");
        let l = UnixListener::bind(&sock).unwrap();
        let url = format!(
            "http+unix://{}",
            sock.display().to_string().replace('/', "%2F")
        );
        Model::start(
            url,
            Some(dir),
            move || l.accept().map(|(s, _)| s),
            models,
            script,
            todo_path,
        )
    }

    /// A relay on 127.0.0.1 to the model server at `upstream` (`127.0.0.1:PORT`).
    pub fn relay(upstream: &str) -> Model {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let calls = Arc::new(Mutex::new(0));
        let state = Arc::new(State {
            models: Vec::new(),
            script: Mutex::new(Vec::new()),
            seen: Arc::clone(&seen),
            models_calls: Arc::clone(&calls),
            todo_path: None,
            upstream: Some(upstream.to_string()),
        });
        std::thread::spawn(move || loop {
            if let Ok((s, _)) = l.accept() {
                let st = Arc::clone(&state);
                std::thread::spawn(move || serve(s, &st));
            }
        });
        Model {
            url,
            seen,
            models_calls: calls,
            _dir: None,
        }
    }

    /// Serves every connection `accept` yields, each on its own thread, until the test ends.
    fn start<S: Read + Write + Send + 'static>(
        url: String,
        dir: Option<tempfile::TempDir>,
        mut accept: impl FnMut() -> std::io::Result<S> + Send + 'static,
        models: &[&str],
        script: Vec<Reply>,
        todo_path: Option<&Path>,
    ) -> Model {
        let (state, seen, calls) = state(models, script, todo_path);
        std::thread::spawn(move || loop {
            if let Ok(s) = accept() {
                let st = Arc::clone(&state);
                std::thread::spawn(move || serve(s, &st));
            }
        });
        Model {
            url,
            seen,
            models_calls: calls,
            _dir: dir,
        }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// The content of the last message of chat request `i`.
    pub fn last_message(&self, i: usize) -> String {
        let s = self.seen();
        let msgs = s[i].body["messages"].as_array().unwrap();
        msgs.last().unwrap()["content"]
            .as_str()
            .unwrap()
            .to_string()
    }
}

type Parts = (Arc<State>, Arc<Mutex<Vec<Seen>>>, Arc<Mutex<u32>>);

fn state(models: &[&str], mut script: Vec<Reply>, todo: Option<&Path>) -> Parts {
    script.reverse();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let calls = Arc::new(Mutex::new(0));
    (
        Arc::new(State {
            models: models.iter().map(|s| s.to_string()).collect(),
            script: Mutex::new(script),
            seen: Arc::clone(&seen),
            models_calls: Arc::clone(&calls),
            todo_path: todo.map(Path::to_path_buf),
            upstream: None,
        }),
        seen,
        calls,
    )
}

fn serve<S: Read + Write>(mut s: S, st: &State) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    while buf.len() < head_end + len {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let body = &buf[head_end..head_end + len];
    let first = head.lines().next().unwrap_or("").to_string();
    if let Some(up) = &st.upstream {
        if first.starts_with("POST /v1/chat/completions") {
            st.seen.lock().unwrap().push(Seen {
                body: serde_json::from_slice(body).unwrap_or(Value::Null),
                todo_json: None,
            });
        }
        let _ = s.write_all(&forward(up, &first, body));
        return;
    }
    let (status, text) = if first.starts_with("GET /v1/models") {
        *st.models_calls.lock().unwrap() += 1;
        let data: Vec<Value> = st
            .models
            .iter()
            .map(|m| json!({ "id": m, "object": "model" }))
            .collect();
        (200, json!({ "object": "list", "data": data }).to_string())
    } else if first.starts_with("POST /v1/chat/completions") {
        let todo_json = st
            .todo_path
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| serde_json::from_slice(&b).ok());
        st.seen.lock().unwrap().push(Seen {
            body: serde_json::from_slice(body).unwrap_or(Value::Null),
            todo_json,
        });
        let next = st.script.lock().unwrap().pop();
        match next {
            None => (500, r#"{"error":"script exhausted"}"#.to_string()),
            Some(Reply::Status(code, text)) => (code, text),
            Some(Reply::Action(v)) => (200, completion(&v.to_string())),
            Some(Reply::Raw(t)) => (200, completion(&t)),
            Some(Reply::Slow(d, v)) => {
                std::thread::sleep(d);
                (200, completion(&v.to_string()))
            }
        }
    } else {
        (404, r#"{"error":"not found"}"#.to_string())
    };
    let resp = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
    let _ = s.write_all(resp.as_bytes());
}

/// `first` (the request line) and `body` sent to `upstream` on a connection of its own;
/// the whole response, as it came (a 502 when the server cannot be reached).
fn forward(upstream: &str, first: &str, body: &[u8]) -> Vec<u8> {
    let bad = |e: std::io::Error| {
        let text = format!("relay: {upstream}: {e}");
        format!(
            "HTTP/1.1 502 X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
            text.len()
        )
        .into_bytes()
    };
    let mut up = match std::net::TcpStream::connect(upstream) {
        Ok(up) => up,
        Err(e) => return bad(e),
    };
    let _ = up.set_read_timeout(Some(Duration::from_secs(300)));
    let head = format!(
        "{first}\r\nHost: {upstream}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut out = Vec::new();
    match up
        .write_all(head.as_bytes())
        .and_then(|()| up.write_all(body))
        .and_then(|()| up.read_to_end(&mut out))
    {
        Ok(_) => out,
        Err(e) => bad(e),
    }
}

/// OpenAI's exact completion shape (testkit's), as text.
fn completion(content: &str) -> String {
    cynode_testkit::scripted_model::completion(content).to_string()
}
