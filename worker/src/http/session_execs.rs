//! The streamed exec routes: `GET /v1/worker/sessions/{id}/execs/{exec_id}` (an
//! `ExecState`; `?wait=true&timeout_ms=N` answers once the command ended or the wait ran
//! out) and `GET …/execs/{exec_id}/output` (server-sent events). What they do is in
//! [`crate::sessions::stream`].
//!
//! The output starts at per-stream byte offsets: `stdout_offset` and `stderr_offset`
//! (`offset` sets both; default 0), or the `Last-Event-ID` header an SSE client sends
//! when it reconnects. Events: `stdout` and `stderr` (data: `{"offset", "data"}`, the
//! bytes base64), `cut` (data: `{"stream", "from", "to"}`, bytes no longer kept), and
//! `exit` (data: the `ExecState`) last. Every event's `id` is `<stdout>,<stderr>`, the
//! offsets read up to, so a reader that drops resumes from the last id it saw and loses
//! nothing the node kept. A comment line every [`KEEPALIVE`] while nothing happens.
//!
//! `POST …/execs/{exec_id}/stdin` writes the raw body (`application/octet-stream`, at most
//! [`MAX_STDIN_CALL`] bytes; a larger one is 413 and nothing of it is written) to the
//! stdin of an exec started with `"stdin": true`, answering a `StdinWritten` once the bytes
//! are in the command's pipe; `?close=true` then closes the stdin (an empty body only
//! closes it). `POST …/execs/{exec_id}:signal` with `{"signal": "TERM"}` signals the
//! command's process group (allow-list: TERM, INT, KILL, HUP, QUIT, USR1, USR2), answering
//! a `SignalSent`. The named errors (`exec_ended`, `stdin_blocked`, `stdin_not_open`,
//! `signal_unsupported`) and bounds are in [`crate::sessions::stream`].

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use cynode_protocol::worker_session_io::{ExecSignalRequest, OutputChunk, OutputCut};
use cynode_protocol::ValidationError;
use tokio::io::AsyncWriteExt;

use super::error::ApiError;
use crate::backend::capture::Which;
use crate::node::Node;
use crate::sessions::stream::{ExecOutput, OutputEvent, MAX_STDIN_CALL};

/// How often an idle event stream says it is alive.
pub const KEEPALIVE: Duration = Duration::from_secs(15);

/// The streamed exec routes, for the authenticated `/v1` router.
pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route(
            "/v1/worker/sessions/{session_id}/execs/{exec_id}",
            get(state).post(action),
        )
        .route(
            "/v1/worker/sessions/{session_id}/execs/{exec_id}/stdin",
            post(stdin),
        )
        .route(
            "/v1/worker/sessions/{session_id}/execs/{exec_id}/output",
            get(output),
        )
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StateQuery {
    #[serde(default)]
    wait: bool,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputQuery {
    #[serde(default)]
    offset: Option<u64>,
    #[serde(default)]
    stdout_offset: Option<u64>,
    #[serde(default)]
    stderr_offset: Option<u64>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StdinQuery {
    #[serde(default)]
    close: bool,
}

fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(q)| q)
        .map_err(|e| ApiError::Invalid(ValidationError::new("query", e.body_text())))
}

async fn state(
    State(node): State<Arc<Node>>,
    Path((session_id, exec_id)): Path<(String, String)>,
    q: Result<Query<StateQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let wait = q.wait.then(|| {
        Duration::from_millis(
            q.timeout_ms
                .unwrap_or(crate::sessions::stream::MAX_WAIT.as_millis() as u64),
        )
    });
    Ok(Json(
        node.sessions
            .exec_state(&session_id, &exec_id, wait)
            .await?,
    )
    .into_response())
}

/// `POST …/execs/{exec_id}:signal` (the router cannot split a segment).
async fn action(
    State(node): State<Arc<Node>>,
    Path((session_id, segment)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let Some(exec_id) = segment.strip_suffix(":signal") else {
        return Err(ApiError::NotFound(format!(
            "no action in `{segment}`: expected :signal"
        )));
    };
    let req: ExecSignalRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::Invalid(ValidationError::new("signal", e.to_string())))?;
    Ok(Json(
        node.sessions
            .signal_exec(&session_id, exec_id, &req.signal)
            .await?,
    )
    .into_response())
}

/// `POST …/execs/{exec_id}/stdin[?close=true]`: the body, bounded before it is read in
/// full (a declared or actual length over [`MAX_STDIN_CALL`] is 413, nothing written).
async fn stdin(
    State(node): State<Arc<Node>>,
    Path((session_id, exec_id)): Path<(String, String)>,
    headers: HeaderMap,
    q: Result<Query<StdinQuery>, QueryRejection>,
    body: Body,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_STDIN_CALL as u64) {
        return Err(ApiError::TooLarge(MAX_STDIN_CALL));
    }
    let bytes = axum::body::to_bytes(body, MAX_STDIN_CALL)
        .await
        .map_err(|_| ApiError::TooLarge(MAX_STDIN_CALL))?;
    Ok(Json(
        node.sessions
            .write_stdin(&session_id, &exec_id, bytes.to_vec(), q.close)
            .await?,
    )
    .into_response())
}

/// `Last-Event-ID: <stdout>,<stderr>`, as this module writes ids.
fn last_event_id(headers: &HeaderMap) -> Result<Option<(u64, u64)>, ApiError> {
    let Some(v) = headers.get("last-event-id") else {
        return Ok(None);
    };
    let bad = || {
        ApiError::Invalid(ValidationError::new(
            "Last-Event-ID",
            "expected <stdout offset>,<stderr offset>",
        ))
    };
    let (a, b) = v
        .to_str()
        .map_err(|_| bad())?
        .split_once(',')
        .ok_or_else(bad)?;
    Ok(Some((
        a.trim().parse().map_err(|_| bad())?,
        b.trim().parse().map_err(|_| bad())?,
    )))
}

async fn output(
    State(node): State<Arc<Node>>,
    Path((session_id, exec_id)): Path<(String, String)>,
    headers: HeaderMap,
    q: Result<Query<OutputQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let base = q.offset.unwrap_or(0);
    let offsets = match last_event_id(&headers)? {
        Some(o) => o,
        None => (
            q.stdout_offset.unwrap_or(base),
            q.stderr_offset.unwrap_or(base),
        ),
    };
    let reader = node.sessions.exec_output(&session_id, &exec_id, offsets)?;
    let (tx, rx) = tokio::io::duplex(64 * 1024);
    tokio::spawn(pump(reader, tx));
    let mut resp = Body::from_stream(tokio_util::io::ReaderStream::new(rx)).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(resp)
}

fn name(which: Which) -> &'static str {
    match which {
        Which::Stdout => "stdout",
        Which::Stderr => "stderr",
    }
}

/// One SSE event's text.
fn event(ev: &OutputEvent, (out, err): (u64, u64)) -> String {
    let (kind, data) = match ev {
        OutputEvent::Chunk {
            which,
            offset,
            bytes,
        } => (
            name(*which),
            serde_json::to_string(&OutputChunk {
                offset: *offset,
                data: base64::engine::general_purpose::STANDARD.encode(bytes),
            }),
        ),
        OutputEvent::Cut { which, from, to } => (
            "cut",
            serde_json::to_string(&OutputCut {
                stream: name(*which).into(),
                from: *from,
                to: *to,
            }),
        ),
        OutputEvent::Exit(state) => ("exit", serde_json::to_string(state)),
    };
    let data = data.unwrap_or_else(|_| "{}".into());
    format!("event: {kind}\nid: {out},{err}\ndata: {data}\n\n")
}

/// Writes the exec's events to the response until the exit event or the client leaves.
async fn pump(mut reader: ExecOutput, mut tx: tokio::io::DuplexStream) {
    loop {
        let text = match tokio::time::timeout(KEEPALIVE, reader.next()).await {
            Ok(Some(ev)) => event(&ev, reader.offsets()),
            Ok(None) => return,
            Err(_) => ": keepalive\n\n".to_string(),
        };
        if tx.write_all(text.as_bytes()).await.is_err() {
            return;
        }
    }
}
