//! The sandbox routes of `serve` (`/v1/sandboxes…`, `/v1/snapshots/{id}`): a worker's
//! session for the caller's tenant, through [`crate::app::sandboxes`] (ownership and
//! policy there). After the create, each route is its worker route below
//! `/v1/worker/sessions/{id}` with the same query, body and answer:
//!
//! | PM route | worker route |
//! |---|---|
//! | `POST /v1/sandboxes` | `POST /v1/worker/sessions` (PM-named, policy-checked) |
//! | `GET /v1/sandboxes/{id}` | `GET …/{id}` |
//! | `POST /v1/sandboxes/{id}:suspend`, `:resume`, `:end` | `POST …/{id}:suspend`, `:resume`, `…/{id}/end` |
//! | `POST /v1/sandboxes/{id}/exec` | `POST …/{id}/exec` (`stream: true` answers an exec id) |
//! | `GET /v1/sandboxes/{id}/execs/{exec}` (`?wait=true&timeout_ms=`), `POST …/{exec}:signal` | the same |
//! | `POST /v1/sandboxes/{id}/execs/{exec}/stdin` (`?close=true`) | the same |
//! | `GET /v1/sandboxes/{id}/execs/{exec}/output` (SSE, `?offset=`, `Last-Event-ID`) | the same |
//! | `GET`, `PUT /v1/sandboxes/{id}/files?path=` (`&list=true`) | the same |
//! | `POST`, `GET /v1/sandboxes/{id}/snapshots` | the same |
//! | `DELETE /v1/snapshots/{snapshot_id}` | `DELETE /v1/worker/snapshots/{snapshot_id}` |
//!
//! Query keys are closed per route (an unknown one is a 400 naming it). Execs, waits and
//! output streams are mounted outside the request timeout: they last as long as the
//! command.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};

use cynode_protocol::pm_sandboxes::{CreateSandbox, SandboxList};
use cynode_protocol::worker_sessions::ExecRequest;

use super::extract::ApiJson;
use crate::app::auth::Tenant;
use crate::app::problem::Problem;
use crate::app::sandboxes::{self, Call};
use crate::app::AppState;

/// The routes answered within the request timeout.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/sandboxes", post(create).get(list))
        .route("/v1/sandboxes/{id}", get(show).post(action))
        .route(
            "/v1/sandboxes/{id}/snapshots",
            post(create_snapshot).get(list_snapshots),
        )
        .route("/v1/snapshots/{snapshot_id}", delete(delete_snapshot))
        .route("/v1/sandboxes/{id}/files", get(read_files).put(write_file))
        .route("/v1/sandboxes/{id}/execs/{exec_id}/stdin", post(stdin))
        .route("/v1/sandboxes/{id}/execs/{exec_id}", post(exec_action))
}

/// The routes that last as long as a command (no request timeout).
pub fn long_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/execs/{exec_id}", get(exec_state))
        .route("/v1/sandboxes/{id}/execs/{exec_id}/output", get(output))
}

/// The worker's answer as this service's: its status, its body streamed, its content
/// type kept only when it is one the worker's sandbox routes send (else
/// `application/octet-stream`), and `X-Content-Type-Options: nosniff`.
pub fn relay(r: reqwest::Response) -> Response {
    let status = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = r
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .filter(|m| {
            matches!(
                m.as_str(),
                "application/json" | "application/problem+json" | "text/event-stream"
            )
        })
        .unwrap_or_else(|| "application/octet-stream".into());
    let chunks = futures_util::stream::unfold(Some(r), |state| async move {
        let mut r = state?;
        match r.chunk().await {
            Ok(Some(c)) => Some((Ok::<Bytes, std::io::Error>(c), Some(r))),
            Ok(None) => None,
            Err(e) => Some((Err(std::io::Error::other(e.to_string())), None)),
        }
    });
    let mut resp = Response::new(Body::from_stream(chunks));
    *resp.status_mut() = status;
    if let Ok(v) = header::HeaderValue::from_str(&content_type) {
        resp.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    // The bytes are the sandbox's: never sniffed into something a browser would run.
    resp.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    if content_type == "text/event-stream" {
        resp.headers_mut().insert(
            header::CACHE_CONTROL,
            header::HeaderValue::from_static("no-cache"),
        );
    }
    resp
}

/// The query's pairs, each key one of `allowed` (400 naming any other).
fn query(
    raw: Option<String>,
    allowed: &[&'static str],
) -> Result<Vec<(&'static str, String)>, Problem> {
    let raw = raw.unwrap_or_default();
    url::form_urlencoded::parse(raw.as_bytes())
        .map(|(k, v)| match allowed.iter().find(|a| **a == k) {
            Some(a) => Ok((*a, v.into_owned())),
            None => Err(Problem::bad_request(format!(
                "query: unknown parameter `{k}` (expected {})",
                allowed.join(", ")
            ))),
        })
        .collect()
}

/// Create a sandbox: a worker's session for the tenant, under its policy; a fork with
/// `from_snapshot`.
#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandbox,
    responses((status = 201, description = "the worker's SessionInfo"), (status = 400, body = Problem),
              (status = 401, body = Problem), (status = 403, body = Problem), (status = 404, body = Problem)),
    security(("bearer" = [])))]
pub async fn create(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    ApiJson(req): ApiJson<CreateSandbox>,
) -> Result<Response, Problem> {
    Ok(relay(sandboxes::create(&st, &tenant, &req).await?))
}

/// List the tenant's sandboxes, newest first.
#[utoipa::path(get, path = "/v1/sandboxes",
    responses((status = 200, body = SandboxList), (status = 401, body = Problem)),
    security(("bearer" = [])))]
pub async fn list(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
) -> Result<Json<SandboxList>, Problem> {
    Ok(Json(sandboxes::list(&st, &tenant).await?))
}

/// Show a sandbox (the worker's SessionInfo: status, suspended or not, workspace).
#[utoipa::path(get, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, description = "the worker's SessionInfo"), (status = 404, body = Problem)),
    security(("bearer" = [])))]
pub async fn show(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    let c = Call::simple(reqwest::Method::GET, "", &[]);
    Ok(relay(sandboxes::call(&st, &tenant, &id, c).await?))
}

/// `:suspend` (body: `{"memory": false}` or none), `:resume` or `:end` a sandbox.
#[utoipa::path(post, path = "/v1/sandboxes/{id_action}",
    params(("id_action" = String, Path, description = "the sandbox id and `:suspend`, `:resume` or `:end`")),
    request_body(content = Vec<u8>, content_type = "application/json", description = "for `:suspend`, the worker's SuspendRequest (`{\"memory\": false}`) or nothing"),
    responses((status = 200, description = "the worker's SessionInfo"), (status = 400, body = Problem),
              (status = 404, body = Problem), (status = 409, body = Problem)),
    security(("bearer" = [])))]
pub async fn action(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(segment): Path<String>,
    body: Bytes,
) -> Result<Response, Problem> {
    let (id, call) = if let Some(id) = segment.strip_suffix(":suspend") {
        let suspend: cynode_protocol::worker_session_state::SuspendRequest =
            if body.iter().all(u8::is_ascii_whitespace) {
                Default::default()
            } else {
                serde_json::from_slice(&body)
                    .map_err(|e| Problem::bad_request(format!("body: {e}")))?
            };
        let body = serde_json::to_vec(&suspend).map_err(|e| Problem::internal(e.to_string()))?;
        let mut c = Call::simple(reqwest::Method::POST, ":suspend", &[]);
        c.body = Some((body.into(), "application/json"));
        (id, c)
    } else if let Some(id) = segment.strip_suffix(":resume") {
        (id, Call::simple(reqwest::Method::POST, ":resume", &[]))
    } else if let Some(id) = segment.strip_suffix(":end") {
        (id, Call::simple(reqwest::Method::POST, "", &["end"]))
    } else {
        return Err(Problem::not_found(format!(
            "action in `{segment}` (expected :suspend, :resume or :end)"
        )));
    };
    Ok(relay(sandboxes::call(&st, &tenant, id, call).await?))
}

/// Run a command in the sandbox: the worker's ExecResponse when it ends, or with
/// `stream: true` an exec id at once (its output at `…/execs/{exec_id}/output`).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", params(("id" = String, Path)),
    request_body(content = Object, description = "the worker's ExecRequest"),
    responses((status = 200, description = "the worker's ExecResponse"), (status = 202, description = "the worker's ExecStarted"),
              (status = 400, body = Problem), (status = 404, body = Problem), (status = 409, body = Problem)),
    security(("bearer" = [])))]
pub async fn exec(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ExecRequest>,
) -> Result<Response, Problem> {
    let body = serde_json::to_vec(&req).map_err(|e| Problem::internal(e.to_string()))?;
    let mut c = Call::simple(reqwest::Method::POST, "", &["exec"]);
    c.body = Some((body.into(), "application/json"));
    c.stream = true;
    Ok(relay(sandboxes::call(&st, &tenant, &id, c).await?))
}

/// A streamed exec's state; `?wait=true` answers once it ended.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/execs/{exec_id}",
    params(("id" = String, Path), ("exec_id" = String, Path), ("wait" = Option<bool>, Query),
           ("timeout_ms" = Option<u64>, Query, description = "with `wait`: answer the state after this long at most")),
    responses((status = 200, description = "the worker's ExecState"), (status = 404, body = Problem)),
    security(("bearer" = [])))]
pub async fn exec_state(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path((id, exec_id)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Problem> {
    let q = query(raw, &["wait", "timeout_ms"])?;
    let path = ["execs", exec_id.as_str()];
    let mut c = Call::simple(reqwest::Method::GET, "", &path);
    c.query = &q;
    c.stream = true;
    Ok(relay(sandboxes::call(&st, &tenant, &id, c).await?))
}

/// `:signal` a streamed exec (body: the worker's ExecSignalRequest).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/execs/{exec_id_action}",
    params(("id" = String, Path), ("exec_id_action" = String, Path, description = "the exec id and `:signal`")),
    request_body(content = Object, description = "the worker's ExecSignalRequest"),
    responses((status = 200, description = "the worker's SignalSent"), (status = 400, body = Problem), (status = 404, body = Problem)),
    security(("bearer" = [])))]
pub async fn exec_action(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path((id, exec_id)): Path<(String, String)>,
    ApiJson(req): ApiJson<cynode_protocol::worker_session_io::ExecSignalRequest>,
) -> Result<Response, Problem> {
    let body = serde_json::to_vec(&req).map_err(|e| Problem::internal(e.to_string()))?;
    let path = ["execs", exec_id.as_str()];
    let mut c = Call::simple(reqwest::Method::POST, "", &path);
    c.body = Some((body.into(), "application/json"));
    Ok(relay(sandboxes::call(&st, &tenant, &id, c).await?))
}

/// Write to a streamed exec's standard input (`?close=true` closes it after).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/execs/{exec_id}/stdin",
    params(("id" = String, Path), ("exec_id" = String, Path), ("close" = Option<bool>, Query)),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, description = "the worker's StdinWritten"), (status = 404, body = Problem), (status = 409, body = Problem)),
    security(("bearer" = [])))]
pub async fn stdin(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path((id, exec_id)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<Response, Problem> {
    let q = query(raw, &["close"])?;
    let path = ["execs", exec_id.as_str(), "stdin"];
    let mut c = Call::simple(reqwest::Method::POST, "", &path);
    c.query = &q;
    c.body = Some((body.into(), "application/octet-stream"));
    Ok(relay(sandboxes::call(&st, &tenant, &id, c).await?))
}

/// A streamed exec's output as Server-Sent Events, from a byte offset (`?offset=`, or
/// per stream `stdout_offset`/`stderr_offset`, or `Last-Event-ID`); `cut` events name
/// what the node's bounded ring no longer held.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/execs/{exec_id}/output",
    params(("id" = String, Path), ("exec_id" = String, Path), ("offset" = Option<u64>, Query),
           ("stdout_offset" = Option<u64>, Query), ("stderr_offset" = Option<u64>, Query)),
    responses((status = 200, description = "text/event-stream"), (status = 404, body = Problem)),
    security(("bearer" = [])))]
pub async fn output(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path((id, exec_id)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let q = query(raw, &["offset", "stdout_offset", "stderr_offset"])?;
    let last: Vec<(&'static str, String)> = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(|v| vec![("last-event-id", v.to_string())])
        .unwrap_or_default();
    let path = ["execs", exec_id.as_str(), "output"];
    let mut c = Call::simple(reqwest::Method::GET, "", &path);
    c.query = &q;
    c.headers = &last;
    c.stream = true;
    Ok(relay(sandboxes::call(&st, &tenant, &id, c).await?))
}

/// Read a file (`?path=`), or list a directory (`&list=true`), of the sandbox's
/// workspace, without an exec; beneath-safe and bounded on the worker.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files",
    params(("id" = String, Path), ("path" = String, Query), ("list" = Option<bool>, Query)),
    responses((status = 200, description = "the bytes, or the worker's FileListing"), (status = 400, body = Problem), (status = 404, body = Problem)),
    security(("bearer" = [])))]
pub async fn read_files(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Problem> {
    let q = query(raw, &["path", "list"])?;
    let mut c = Call::simple(reqwest::Method::GET, "", &["files"]);
    c.query = &q;
    c.stream = true;
    Ok(relay(sandboxes::call(&st, &tenant, &id, c).await?))
}

/// Write a file (`?path=`) of the sandbox's workspace atomically, without an exec.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files",
    params(("id" = String, Path), ("path" = String, Query)),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, description = "the worker's FileWritten"), (status = 400, body = Problem), (status = 404, body = Problem), (status = 413, body = Problem)),
    security(("bearer" = [])))]
pub async fn write_file(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<Response, Problem> {
    let q = query(raw, &["path"])?;
    let mut c = Call::simple(reqwest::Method::PUT, "", &["files"]);
    c.query = &q;
    c.body = Some((body.into(), "application/octet-stream"));
    Ok(relay(sandboxes::call(&st, &tenant, &id, c).await?))
}

/// Snapshot the sandbox's workspace (paused for it): the worker's SnapshotInfo, with its
/// tree hash. The snapshot is the tenant's: a fork is a create with `from_snapshot`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", params(("id" = String, Path)),
    responses((status = 201, description = "the worker's SnapshotInfo"), (status = 404, body = Problem), (status = 409, body = Problem)),
    security(("bearer" = [])))]
pub async fn create_snapshot(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    let (status, v) = sandboxes::snapshot(&st, &tenant, &id).await?;
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    Ok((status, Json(v)).into_response())
}

/// The snapshots of the tenant's sandboxes on this sandbox's worker.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/snapshots", params(("id" = String, Path)),
    responses((status = 200, description = "the worker's SnapshotList"), (status = 404, body = Problem)),
    security(("bearer" = [])))]
pub async fn list_snapshots(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    let c = Call::simple(reqwest::Method::GET, "", &["snapshots"]);
    Ok(relay(sandboxes::call(&st, &tenant, &id, c).await?))
}

/// Delete one of the tenant's snapshots.
#[utoipa::path(delete, path = "/v1/snapshots/{snapshot_id}", params(("snapshot_id" = String, Path)),
    responses((status = 200, description = "deleted"), (status = 404, body = Problem)),
    security(("bearer" = [])))]
pub async fn delete_snapshot(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(snapshot_id): Path<String>,
) -> Result<Response, Problem> {
    Ok(relay(
        sandboxes::delete_snapshot(&st, &tenant, &snapshot_id).await?,
    ))
}
