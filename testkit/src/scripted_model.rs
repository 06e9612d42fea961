//! The one scripted model of the tests: an OpenAI-compatible server (real HTTP on
//! 127.0.0.1, OpenAI's exact chat completion shape) that answers each chat completion
//! with the next scripted [`Reply`] and records every request it gets.
//!
//! It serves from a thread of its own, so sync and async tests use it alike; the thread
//! ends with the test process. [`ScriptedModel::router`] gives its routes for a server of
//! the caller's own (over TLS, say).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

/// What the server answers to one chat completion request.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// 200 with a chat completion whose content is this.
    Content(String),
    /// 200 with this content and `finish_reason: length` (cut off at max_tokens).
    Cut(String),
    /// This status and body.
    Status(u16, String),
    /// Never answers.
    Hang,
}

impl From<Value> for Reply {
    /// A JSON string is the content itself; any other value is sent as its JSON text.
    fn from(v: Value) -> Reply {
        match v {
            Value::String(s) => Reply::Content(s),
            other => Reply::Content(other.to_string()),
        }
    }
}

/// One request the server got.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub path: String,
    /// The `Authorization` header, when sent.
    pub authorization: Option<String>,
    /// The JSON body (`null` for a GET).
    pub body: Value,
}

struct Inner {
    script: Mutex<VecDeque<Reply>>,
    /// What is answered once the script is used up.
    exhausted: Reply,
    requests: Mutex<Vec<Recorded>>,
}

/// A scripted model server's script and record (cheap to clone: one shared state).
#[derive(Clone)]
pub struct ScriptedModel {
    inner: Arc<Inner>,
}

impl ScriptedModel {
    /// Answers with `script` in order, then with `exhausted` forever.
    pub fn new(script: impl IntoIterator<Item = Reply>, exhausted: Reply) -> ScriptedModel {
        ScriptedModel {
            inner: Arc::new(Inner {
                script: Mutex::new(script.into_iter().collect()),
                exhausted,
                requests: Mutex::default(),
            }),
        }
    }

    /// Answers with `script` in order; its last entry repeats forever (a 500 when empty).
    pub fn repeating_last(mut script: Vec<Reply>) -> ScriptedModel {
        let last = script
            .pop()
            .unwrap_or_else(|| Reply::Status(500, "empty script".into()));
        ScriptedModel::new(script, last)
    }

    /// The routes: `POST /v1/chat/completions` and `GET /v1/models`.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/v1/models", get(models))
            .with_state(self.inner.clone())
    }

    /// Serves on 127.0.0.1 (any port) from a thread of its own; returns the base URL,
    /// `http://127.0.0.1:PORT/v1`.
    pub fn serve(&self) -> String {
        format!("http://{}/v1", serve_in_background(self.router()))
    }

    /// Every request so far, in order.
    pub fn requests(&self) -> Vec<Recorded> {
        self.inner
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The bodies of the chat completion requests so far, in order.
    pub fn chat_bodies(&self) -> Vec<Value> {
        self.requests()
            .into_iter()
            .filter(|r| r.path == "/v1/chat/completions")
            .map(|r| r.body)
            .collect()
    }
}

impl Inner {
    fn record(&self, path: &str, headers: &HeaderMap, body: Value) {
        let authorization = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Recorded {
                path: path.to_string(),
                authorization,
                body,
            });
    }

    fn next(&self) -> Reply {
        let mut script = self.script.lock().unwrap_or_else(PoisonError::into_inner);
        script.pop_front().unwrap_or_else(|| self.exhausted.clone())
    }
}

/// A chat completion exactly as OpenAI's API returns it.
pub fn completion(content: &str) -> Value {
    json!({
        "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
        "object": "chat.completion",
        "created": 1741569952,
        "model": "test-model",
        "choices": [{
            "index": 0,
            "message": {
                "role": "assistant",
                "content": content,
                "refusal": null,
                "annotations": []
            },
            "logprobs": null,
            "finish_reason": "stop"
        }],
        "usage": {
            "prompt_tokens": 19,
            "completion_tokens": 10,
            "total_tokens": 29,
            "prompt_tokens_details": { "cached_tokens": 0, "audio_tokens": 0 },
            "completion_tokens_details": {
                "reasoning_tokens": 0, "audio_tokens": 0,
                "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0
            }
        },
        "service_tier": "default",
        "system_fingerprint": "fp_44709d6fcb"
    })
}

async fn chat(
    State(s): State<Arc<Inner>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    s.record("/v1/chat/completions", &headers, body);
    match s.next() {
        Reply::Content(content) => Json(completion(&content)).into_response(),
        Reply::Cut(content) => {
            let mut c = completion(&content);
            c["choices"][0]["finish_reason"] = json!("length");
            Json(c).into_response()
        }
        Reply::Status(code, body) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, body).into_response()
        }
        Reply::Hang => std::future::pending::<Response>().await,
    }
}

async fn models(State(s): State<Arc<Inner>>, headers: HeaderMap) -> Json<Value> {
    s.record("/v1/models", &headers, Value::Null);
    Json(json!({
        "object": "list",
        "data": [
            { "id": "smollm2", "object": "model", "created": 1686935002, "owned_by": "llamacpp" },
            { "id": "gpt-4o-mini", "object": "model", "created": 1686935002, "owned_by": "openai" }
        ]
    }))
}

/// Serves `app` on 127.0.0.1 (any port) from a thread of its own, so sync tests can use
/// it; returns its address.
pub fn serve_in_background(app: Router) -> std::net::SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("a runtime for the test server: {e}"));
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .unwrap_or_else(|e| panic!("a port on 127.0.0.1: {e}"));
            let _ = tx.send(
                l.local_addr()
                    .unwrap_or_else(|e| panic!("the bound address: {e}")),
            );
            let _ = axum::serve(l, app).await;
        });
    });
    rx.recv()
        .unwrap_or_else(|e| panic!("the test server started: {e}"))
}
