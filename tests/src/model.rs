//! The scripted model of the cross-binary tests: an OpenAI-compatible server (real HTTP)
//! that answers each chat completion with the next scripted reply and records every
//! request.

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::serve::serve_in_background;

/// A scripted model: answers each chat completion with the next scripted content.
#[derive(Clone, Default)]
pub struct Model {
    script: Arc<Mutex<Vec<String>>>,
    requests: Arc<Mutex<Vec<Value>>>,
}

impl Model {
    pub fn requests(&self) -> Vec<Value> {
        self.requests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

async fn completions(State(m): State<Model>, Json(body): Json<Value>) -> Json<Value> {
    m.requests
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(body);
    let content = {
        let mut s = m
            .script
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if s.is_empty() {
            "{\"type\":\"final\",\"state_patch\":[],\"payload\":{\"summary\":\"script exhausted\"}}"
                .to_string()
        } else {
            s.remove(0)
        }
    };
    Json(json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "smollm2",
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": content }, "finish_reason": "stop" }],
        "usage": { "prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20 }
    }))
}

async fn models() -> Json<Value> {
    Json(
        json!({ "object": "list", "data": [{ "id": "smollm2", "object": "model", "owned_by": "test" }] }),
    )
}

/// Starts the scripted model on 127.0.0.1 in a background thread; returns its base URL.
pub fn model_server(script: Vec<Value>) -> (String, Model) {
    let (app, m) = model_app(script);
    let addr = serve_in_background(app);
    (format!("http://{addr}/v1"), m)
}

/// The scripted model's routes, for a server of the caller's own (e.g. over TLS).
pub fn model_app(script: Vec<Value>) -> (Router, Model) {
    let m = Model {
        script: Arc::new(Mutex::new(
            script
                .into_iter()
                .map(|v| {
                    if let Value::String(s) = v {
                        s
                    } else {
                        v.to_string()
                    }
                })
                .collect(),
        )),
        ..Default::default()
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .route("/v1/models", get(models))
        .with_state(m.clone());
    (app, m)
}
