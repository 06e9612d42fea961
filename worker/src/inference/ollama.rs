//! Ollama's native API over the node's OpenAI-compatible upstream: `/api/chat` and
//! `/api/generate` become one `/v1/chat/completions` call (text messages, the common
//! `options`, `format: "json"`, tools), and its answer is given back in Ollama's shape;
//! `/api/tags` is the upstream's `/v1/models` list; `/api/version` is answered here.
//!
//! - Only fields this module knows are translated: nothing else of the request reaches the
//!   upstream (the proxy's checks ran on `model` before).
//! - Streaming: Ollama streams unless told `stream: false`. The proxy never streams from
//!   the upstream; a request that wants a stream gets the whole answer as one NDJSON line
//!   (`done: true`, `application/x-ndjson`), which Ollama's clients read as a stream that
//!   ended after one chunk.
//! - Images (`images`) are refused (400): the proxy forwards text only.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

/// The Ollama API level the listener answers as (`GET /api/version`): clients that check
/// it get one that has `/api/chat` with tools.
pub const API_VERSION: &str = "0.6.0";

/// `GET /api/version`.
pub async fn version() -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        json!({ "version": API_VERSION }).to_string(),
    )
        .into_response()
}

/// Whether the client wants a stream (Ollama's default when `stream` is absent).
pub fn wants_stream(req: &Map<String, Value>) -> bool {
    req.get("stream").and_then(Value::as_bool).unwrap_or(true)
}

/// Ollama's `options` (and `format`) as OpenAI request fields.
fn options(req: &Map<String, Value>, out: &mut Map<String, Value>) {
    if let Some(o) = req.get("options").and_then(Value::as_object) {
        for (from, to) in [
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("seed", "seed"),
            ("num_predict", "max_tokens"),
            ("stop", "stop"),
            ("presence_penalty", "presence_penalty"),
            ("frequency_penalty", "frequency_penalty"),
        ] {
            if let Some(v) = o.get(from) {
                out.insert(to.into(), v.clone());
            }
        }
    }
    match req.get("format") {
        Some(Value::String(f)) if f == "json" => {
            out.insert("response_format".into(), json!({ "type": "json_object" }));
        }
        Some(schema @ Value::Object(_)) => {
            out.insert(
                "response_format".into(),
                json!({ "type": "json_schema", "json_schema": { "name": "format", "schema": schema } }),
            );
        }
        _ => {}
    }
}

/// One Ollama message as OpenAI's (role, text content, tool calls with string arguments).
fn message(m: &Value) -> Result<Value, String> {
    if m.get("images").is_some_and(|i| !i.is_null()) {
        return Err("images are not supported: the inference proxy forwards text only".into());
    }
    let role = m["role"].as_str().unwrap_or("user");
    let mut out = json!({ "role": role, "content": m["content"].as_str().unwrap_or_default() });
    if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "id": format!("call_{i}"),
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": c["function"]["arguments"].to_string(),
                    }
                })
            })
            .collect();
        out["tool_calls"] = Value::Array(calls);
    }
    if let Some(name) = m.get("tool_name").or_else(|| m.get("name")) {
        out["name"] = name.clone();
    }
    Ok(out)
}

/// `/api/chat`'s body as an OpenAI chat request.
pub fn chat_request(req: &Map<String, Value>) -> Result<Map<String, Value>, String> {
    let messages = req
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("`messages` must be an array")?
        .iter()
        .map(message)
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = Map::new();
    out.insert("model".into(), req["model"].clone());
    out.insert("messages".into(), Value::Array(messages));
    out.insert("stream".into(), Value::Bool(false));
    if let Some(tools) = req.get("tools").filter(|t| t.is_array()) {
        out.insert("tools".into(), tools.clone());
    }
    options(req, &mut out);
    Ok(out)
}

/// `/api/generate`'s body (`prompt`, `system`) as an OpenAI chat request.
pub fn generate_request(req: &Map<String, Value>) -> Result<Map<String, Value>, String> {
    if req.get("images").is_some_and(|i| !i.is_null()) {
        return Err("images are not supported: the inference proxy forwards text only".into());
    }
    let prompt = req
        .get("prompt")
        .and_then(Value::as_str)
        .ok_or("`prompt` must be a string")?;
    let mut messages = Vec::new();
    if let Some(system) = req.get("system").and_then(Value::as_str) {
        messages.push(json!({ "role": "system", "content": system }));
    }
    messages.push(json!({ "role": "user", "content": prompt }));
    let mut out = Map::new();
    out.insert("model".into(), req["model"].clone());
    out.insert("messages".into(), Value::Array(messages));
    out.insert("stream".into(), Value::Bool(false));
    options(req, &mut out);
    Ok(out)
}

/// The fields every Ollama answer ends with.
fn done(model: &str, v: &Value) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("model".into(), model.into());
    m.insert(
        "created_at".into(),
        cynode_protocol::time::now_rfc3339().into(),
    );
    m.insert("done".into(), true.into());
    m.insert(
        "done_reason".into(),
        v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap_or("stop")
            .into(),
    );
    m.insert(
        "prompt_eval_count".into(),
        v["usage"]["prompt_tokens"].as_u64().unwrap_or(0).into(),
    );
    m.insert(
        "eval_count".into(),
        v["usage"]["completion_tokens"].as_u64().unwrap_or(0).into(),
    );
    m
}

/// An OpenAI completion as `/api/chat`'s answer.
pub fn chat_response(model: &str, v: &Value) -> Value {
    let msg = &v["choices"][0]["message"];
    let mut message = json!({
        "role": "assistant",
        "content": msg["content"].as_str().unwrap_or_default(),
    });
    if let Some(calls) = msg.get("tool_calls").and_then(Value::as_array) {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                let args = &c["function"]["arguments"];
                let args = args
                    .as_str()
                    .and_then(|s| serde_json::from_str::<Value>(s).ok())
                    .unwrap_or_else(|| args.clone());
                json!({ "function": { "name": c["function"]["name"], "arguments": args } })
            })
            .collect();
        message["tool_calls"] = Value::Array(calls);
    }
    let mut m = done(model, v);
    m.insert("message".into(), message);
    Value::Object(m)
}

/// An OpenAI completion as `/api/generate`'s answer.
pub fn generate_response(model: &str, v: &Value) -> Value {
    let mut m = done(model, v);
    m.insert(
        "response".into(),
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .into(),
    );
    Value::Object(m)
}

/// The answer: one JSON object, or that object as the one line of an NDJSON stream.
pub fn answer(v: Value, ndjson: bool) -> Response {
    if ndjson {
        (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/x-ndjson")],
            format!("{v}\n"),
        )
            .into_response()
    } else {
        (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            v.to_string(),
        )
            .into_response()
    }
}

/// The upstream's (already filtered) OpenAI model list as `/api/tags`.
pub fn tags(list: &Value) -> Value {
    let models: Vec<Value> = list["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["id"].as_str())
        .map(|id| {
            json!({
                "name": id, "model": id, "modified_at": "1970-01-01T00:00:00Z",
                "size": 0, "digest": "", "details": {}
            })
        })
        .collect();
    json!({ "models": models })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_request_keeps_text_options_and_tools_only() {
        let req = json!({
            "model": "m", "stream": true, "keep_alive": "5m",
            "messages": [{ "role": "user", "content": "hi" }],
            "options": { "temperature": 0.1, "num_predict": 7, "num_ctx": 4096 },
            "format": "json", "tools": [{ "type": "function", "function": { "name": "f" } }]
        });
        let out = chat_request(req.as_object().unwrap()).unwrap();
        assert_eq!(
            Value::Object(out),
            json!({
                "model": "m", "stream": false,
                "messages": [{ "role": "user", "content": "hi" }],
                "temperature": 0.1, "max_tokens": 7,
                "response_format": { "type": "json_object" },
                "tools": [{ "type": "function", "function": { "name": "f" } }]
            })
        );
        assert!(wants_stream(req.as_object().unwrap()));
        let images = json!({ "model": "m", "messages": [{ "role": "user", "content": "", "images": ["x"] }] });
        assert!(chat_request(images.as_object().unwrap()).is_err());
    }

    #[test]
    fn an_answer_carries_content_tool_calls_and_counts() {
        let v = json!({
            "choices": [{ "finish_reason": "stop", "message": { "content": "yo",
                "tool_calls": [{ "function": { "name": "f", "arguments": "{\"a\":1}" } }] } }],
            "usage": { "prompt_tokens": 3, "completion_tokens": 2 }
        });
        let a = chat_response("m", &v);
        assert_eq!(a["message"]["content"], "yo");
        assert_eq!(
            a["message"]["tool_calls"][0]["function"]["arguments"],
            json!({ "a": 1 })
        );
        assert_eq!(
            (a["prompt_eval_count"].clone(), a["eval_count"].clone()),
            (json!(3), json!(2))
        );
        assert_eq!(generate_response("m", &v)["response"], "yo");
        let t = tags(&json!({ "data": [{ "id": "a" }] }));
        assert_eq!(t["models"][0]["name"], "a");
    }
}
