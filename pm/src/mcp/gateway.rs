//! The sandbox agents' MCP gateway at `/v1/gateway` of `serve`: streamable HTTP (rmcp,
//! stateless, JSON replies) behind job tokens ([`crate::gateway`]), not API tokens. A
//! request is admitted only with a live token; its [`Grant`] scopes every tool to one
//! task of one session of one tenant, and admits only the tools the job lists in its
//! `context.mcp_tools`:
//! - `artifact.put` verifies the bytes against the sha256 the caller states (as job
//!   artifacts are) and stores them content-addressed; they join the session, under the
//!   job, when the job ends; a job may make at most 64 puts of 64 MiB in all
//!   (`gateway::MAX_PUTS_PER_JOB`, `MAX_PUT_BYTES_PER_JOB`), refused beyond (429);
//! - `artifact.list` and `artifact.get` see only the artifacts of the token's task
//!   (jobs of that task, and this job's puts); `get` re-verifies the stored bytes;
//! - `skills.list` and `skills.get` read the catalog;
//! - `web.fetch` goes out from the PM ([`super::egress`]) only to a destination the job's
//!   egress allows: the tenant's `egress.allow` narrowed by the skill's declared `egress`
//!   (the lists the worker's proxy gets for the job), resolved and pinned, special
//!   addresses only when listed, no redirect followed, the reply bounded;
//! - `web.search` asks the PM's search route (a SearxNG-compatible JSON API) by the same
//!   rules as `web.fetch` (the route's host must be in the job's egress), bounded, and
//!   gives back `[{title, url, snippet}]`;
//! - `api.call` goes to one of the PM's credentialed routes that the tenant's
//!   `egress.routes_allowed` names; the PM adds the route's secret headers;
//! - `help.tools` lists the tools, `help.<tool>` describes one.
//!
//! Anything else (`db.*`, `node.*`, `sandbox.*`, skill writes, unknown names) is refused
//! before any work (JSON-RPC -32602, `urn:cynodeai:error:authorization`).
//!
//! `serve` mounts [`router`] beside its API; `cynode-pm run` has no API, so it hosts the
//! gateway alone for its own session with [`host`], on a listener of its own. Every call, refused
//! or not, is audited (tool, outcome, bytes) into the job's entry of the registry, which
//! the session's history receives when the job ends. Tokens never reach a log line.

use std::sync::Arc;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use base64::Engine;
use cynode_protocol::problem::ProblemKind;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ErrorData, Implementation,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::ServerHandler;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::egress;
use crate::app::auth::Tenant;
use crate::app::ops;
use crate::app::problem::Problem;
use crate::app::AppState;
use crate::gateway::{self, AuditEntry, Decision, Grant, PutArtifact};

/// Where `serve` mounts the gateway.
pub const PATH: &str = "/v1/gateway";
/// Largest artifact one `artifact.put` or `artifact.get` carries.
pub const MAX_ARTIFACT_BYTES: usize = 8 << 20;

/// What each tool does, for `tools/list` and `help.*`.
fn describe(tool: &str) -> &'static str {
    match tool {
        "artifact.put" => "Store an artifact of this task: {path, content_base64, sha256}; the bytes must match the sha256.",
        "artifact.get" => "An artifact of this task by sha256 (or path): {sha256?, path?} -> content_base64, re-verified.",
        "artifact.list" => "The artifacts of this task: path, sha256, size_bytes, job_id.",
        "skills.list" => "The skill catalog (read-only).",
        "skills.get" => "One skill's manifest: {skill_id} (read-only).",
        "web.fetch" => "Fetch a URL the task's egress allows: {url, method?: GET|HEAD, headers?} -> {status, headers, body, encoding: text|base64, truncated}; no redirect is followed.",
        "web.search" => "Search the web through the PM's search route (a SearxNG-compatible API the task's egress allows): {query, max_results?} -> {query, count, results: [{title, url, snippet}]}.",
        "api.call" => "Call a credentialed route the tenant allows: {route, method, path, body?, headers?} -> {status, headers, body, encoding, truncated}; the PM adds the route's credentials.",
        "help.tools" => "The gateway's tools and what they do.",
        _ => "",
    }
}

/// The gateway's MCP handler; the grant comes with each request.
#[derive(Clone)]
pub struct Gateway {
    st: Arc<AppState>,
}

/// A refusal or failure of a gateway call.
enum Refusal {
    /// Not on the allowlist: a protocol error, before any work.
    Forbidden(String),
    /// Arguments off the tool's shape.
    BadArguments(String),
    /// The tool ran and refused (not found, integrity, egress denied…).
    Problem(Problem),
}

impl From<Problem> for Refusal {
    fn from(p: Problem) -> Self {
        Refusal::Problem(p)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PutArgs {
    path: String,
    content_base64: String,
    sha256: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GetArgs {
    #[serde(default)]
    sha256: Option<String>,
    #[serde(default)]
    path: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SkillArgs {
    skill_id: String,
}

fn parse<T: for<'de> Deserialize<'de>>(
    tool: &str,
    args: &Map<String, Value>,
) -> Result<T, Refusal> {
    serde_path_to_error::deserialize(Value::Object(args.clone()))
        .map_err(|e| Refusal::BadArguments(format!("{tool}: {}: {}", e.path(), e.inner())))
}

/// How much of a refused path a message repeats.
const MAX_PATH_ECHO: usize = 100;

/// A refusal's text cut to [`gateway::MAX_DETAIL_BYTES`] (a hostile request's echo goes
/// no further: not into the audit, the log or the reply).
fn clipped(out: Result<(Value, u64), Refusal>) -> Result<(Value, u64), Refusal> {
    let cut = |d: String| gateway::clip(&d, gateway::MAX_DETAIL_BYTES);
    match out {
        Ok(v) => Ok(v),
        Err(Refusal::Forbidden(d)) => Err(Refusal::Forbidden(cut(d))),
        Err(Refusal::BadArguments(d)) => Err(Refusal::BadArguments(cut(d))),
        Err(Refusal::Problem(mut p)) => {
            p.0.detail = p.0.detail.map(cut);
            Err(Refusal::Problem(p))
        }
    }
}

/// The refusal of a tool name that is not one (too long, odd bytes): fixed, it does not
/// repeat the name.
fn invalid_name() -> Refusal {
    Refusal::BadArguments(format!(
        "the tool name is not a tool name (1 to {} of A-Z a-z 0-9 . _ -)",
        cynode_protocol::job::MAX_TOOL_NAME
    ))
}

/// The audit entry of a call to `tool` (already [`gateway::INVALID_TOOL`] for a name
/// that is not one) with the clipped outcome `out`, and where an egress tool went.
fn audit_entry(
    tool: &str,
    out: &Result<(Value, u64), Refusal>,
    dest: Option<egress::Dest>,
) -> AuditEntry {
    let (outcome, bytes, detail) = match out {
        Ok((_, n)) => ("ok", *n, None),
        Err(Refusal::Forbidden(d) | Refusal::BadArguments(d)) => ("refused", 0, Some(d.clone())),
        Err(Refusal::Problem(p)) => ("refused", 0, p.0.detail.clone()),
    };
    let decision = dest
        .as_ref()
        .map(|_| if out.is_ok() { "allowed" } else { "denied" }.to_string());
    AuditEntry {
        tool: tool.to_string(),
        outcome: outcome.into(),
        bytes,
        detail: detail.map(|d| gateway::clip(&d, gateway::MAX_DETAIL_BYTES)),
        host: dest
            .as_ref()
            .map(|d| gateway::clip(&d.host, gateway::MAX_DETAIL_BYTES)),
        port: dest.as_ref().map(|d| d.port).filter(|p| *p != 0),
        decision,
    }
}

/// An egress refusal as the tool's problem (its status and reason).
fn egress_refusal(tool: &str, d: egress::Denied) -> Refusal {
    Refusal::Problem(Problem::status(d.status, format!("{tool}: {}", d.reason)))
}

/// A relative artifact path: no `..`, no leading `/`, no NUL, bounded.
fn check_path(p: &str) -> Result<(), Refusal> {
    let ok = !p.is_empty()
        && p.len() <= 512
        && !p.starts_with('/')
        && !p.contains('\0')
        && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..");
    if ok {
        Ok(())
    } else {
        Err(Refusal::BadArguments(format!(
            "artifact.put: path: `{}` must be a relative path of at most 512 bytes without `.`, `..` or empty parts",
            gateway::clip(p, MAX_PATH_ECHO)
        )))
    }
}

impl Gateway {
    /// The artifacts of the grant's task: (path, sha256, size, job_id, location).
    async fn task_artifacts(
        &self,
        g: &Grant,
    ) -> Result<Vec<(String, String, u64, String, String)>, Problem> {
        let (rec, _) = ops::owned(&self.st, &Tenant(g.tenant.clone()), &g.session_id).await?;
        let jobs: Vec<String> = rec
            .state
            .history
            .iter()
            .filter(|h| h.kind == "job_dispatched" && h.data["task_id"] == g.task_id.as_str())
            .filter_map(|h| h.data["job_id"].as_str().map(str::to_string))
            .chain(std::iter::once(g.job_id.clone()))
            .collect();
        let mut out: Vec<_> = rec
            .state
            .artifacts
            .iter()
            .filter(|a| jobs.contains(&a.job_id))
            .map(|a| {
                (
                    a.record.path.clone(),
                    a.record.sha256.clone(),
                    a.record.size_bytes,
                    a.job_id.clone(),
                    a.location.clone(),
                )
            })
            .collect();
        for a in gateway::tokens().artifacts_of(&g.job_id) {
            out.push((a.path, a.sha256, a.size_bytes, g.job_id.clone(), a.location));
        }
        Ok(out)
    }

    /// Where the job of `g` may go: the tenant's `egress.allow` as the ceiling, narrowed
    /// by the skill's declared `egress` when it declares one (as the driver's request to
    /// the worker's proxy is); an empty ceiling allows nothing.
    fn job_policy(&self, g: &Grant) -> Result<cynode_egress::Policy, Refusal> {
        let pm = &self.st.pm;
        let ceiling = cynode_egress::Allowlist::parse(&pm.tenant.egress.allow).map_err(|e| {
            Problem::forbidden(format!("web.fetch: the tenant's egress.allow: {e}"))
        })?;
        let declared = pm
            .registry
            .get(&g.skill_id)
            .map(|s| s.manifest.egress.clone())
            .unwrap_or_default();
        let job = (!declared.is_empty()).then_some(&declared[..]);
        cynode_egress::Policy::for_job(&ceiling, job)
            .map_err(|e| Problem::forbidden(format!("web.fetch: the skill's {e}")).into())
    }

    async fn run(
        &self,
        g: &Grant,
        tool: &str,
        args: &Map<String, Value>,
        dest: &mut Option<egress::Dest>,
    ) -> Result<(Value, u64), Refusal> {
        if let Decision::Forbidden(why) = gateway::decide(tool) {
            return Err(Refusal::Forbidden(why));
        }
        // The job's own list, enforced here too: an SBA (or a job's own client on the
        // socket) calling a tool the job does not list is refused by the gateway.
        if !g.lists(tool) {
            return Err(Refusal::Forbidden(format!(
                "`{tool}` is not in the job's context.mcp_tools"
            )));
        }
        match tool {
            "artifact.put" => {
                let a: PutArgs = parse(tool, args)?;
                check_path(&a.path)?;
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(a.content_base64.as_bytes())
                    .map_err(|e| {
                        Refusal::BadArguments(format!("artifact.put: content_base64: {e}"))
                    })?;
                if bytes.len() > MAX_ARTIFACT_BYTES {
                    return Err(Problem::status(
                        axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                        format!(
                            "artifact {} is {} bytes, over {MAX_ARTIFACT_BYTES}",
                            a.path,
                            bytes.len()
                        ),
                    )
                    .into());
                }
                // Checked before the job's put cap counts it: a put whose bytes do not
                // match uses up nothing.
                if hex::encode(Sha256::digest(&bytes)) != a.sha256 {
                    return Err(Problem::status(
                        axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                        format!(
                            "artifact {}: the bytes do not match the stated sha256",
                            a.path
                        ),
                    )
                    .into());
                }
                gateway::tokens()
                    .admit_put(&g.job_id, bytes.len() as u64)
                    .map_err(|why| {
                        Problem::status(axum::http::StatusCode::TOO_MANY_REQUESTS, why)
                    })?;
                let loc = crate::artifacts::verify_and_store(
                    &self.st.pm.artifacts_dir,
                    &a.path,
                    &a.sha256,
                    bytes.len() as u64,
                    &bytes,
                )
                .map_err(|e| {
                    Problem::status(axum::http::StatusCode::UNPROCESSABLE_ENTITY, e.to_string())
                })?;
                let location = loc.display().to_string();
                self.st
                    .pm
                    .store
                    .put_artifact(&a.sha256, bytes.len() as u64, &location)
                    .await
                    .map_err(Problem::from)?;
                gateway::tokens().put_artifact(
                    &g.job_id,
                    PutArtifact {
                        path: a.path.clone(),
                        sha256: a.sha256.clone(),
                        size_bytes: bytes.len() as u64,
                        location,
                    },
                );
                Ok((
                    json!({ "path": a.path, "sha256": a.sha256, "size_bytes": bytes.len() }),
                    bytes.len() as u64,
                ))
            }
            "artifact.list" => {
                let _: Map<String, Value> = parse(tool, args)?;
                let list: Vec<Value> = self
                    .task_artifacts(g)
                    .await?
                    .into_iter()
                    .map(|(path, sha256, size, job, _)| json!({ "path": path, "sha256": sha256, "size_bytes": size, "job_id": job }))
                    .collect();
                Ok((json!({ "artifacts": list }), 0))
            }
            "artifact.get" => {
                let a: GetArgs = parse(tool, args)?;
                let all = self.task_artifacts(g).await?;
                let found = all.iter().rev().find(|x| {
                    a.sha256.as_deref().is_none_or(|s| s == x.1)
                        && a.path.as_deref().is_none_or(|p| p == x.0)
                });
                let Some((path, sha, _, _, location)) =
                    found.filter(|_| a.sha256.is_some() || a.path.is_some())
                else {
                    return Err(Problem::not_found("artifact of this task").into());
                };
                let bytes = tokio::fs::read(location)
                    .await
                    .map_err(|e| Problem::internal(format!("artifact {sha} unreadable: {e}")))?;
                if hex::encode(Sha256::digest(&bytes)) != *sha {
                    crate::metrics::metrics().artifact_integrity_failures.inc();
                    return Err(Problem::internal(format!(
                        "artifact_integrity_failure: the stored bytes of {sha} no longer match"
                    ))
                    .into());
                }
                if bytes.len() > MAX_ARTIFACT_BYTES {
                    return Err(Problem::status(
                        axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                        format!("artifact {path} is over {MAX_ARTIFACT_BYTES} bytes"),
                    )
                    .into());
                }
                let n = bytes.len() as u64;
                Ok((
                    json!({ "path": path, "sha256": sha, "size_bytes": n,
                    "content_base64": base64::engine::general_purpose::STANDARD.encode(&bytes) }),
                    n,
                ))
            }
            "skills.list" => Ok((ops::skills(&self.st), 0)),
            "skills.get" => {
                let a: SkillArgs = parse(tool, args)?;
                Ok((ops::skill(&self.st, &a.skill_id)?, 0))
            }
            "web.fetch" => {
                let a: egress::FetchArgs = parse(tool, args)?;
                // Known before the policy is: a refusal is audited with its destination.
                *dest = Some(egress::Dest::default());
                let policy = self.job_policy(g)?;
                egress::web_fetch(&policy, a, dest)
                    .await
                    .map_err(|d| egress_refusal(tool, d))
            }
            "web.search" => {
                let a: egress::SearchArgs = parse(tool, args)?;
                *dest = Some(egress::Dest::default());
                let policy = self.job_policy(g)?;
                egress::web_search(&policy, a, dest)
                    .await
                    .map_err(|d| egress_refusal(tool, d))
            }
            "api.call" => {
                let a: egress::CallArgs = parse(tool, args)?;
                *dest = Some(egress::Dest::default());
                egress::api_call(&self.st.pm.tenant.egress.routes_allowed, a, dest)
                    .await
                    .map_err(|d| egress_refusal(tool, d))
            }
            "help.tools" => {
                let tools: Vec<Value> = gateway::TOOLS
                    .iter()
                    .map(|t| json!({ "name": t, "description": describe(t) }))
                    .collect();
                Ok((json!({ "tools": tools }), 0))
            }
            other => match other
                .strip_prefix("help.")
                .filter(|t| gateway::TOOLS.contains(t))
            {
                Some(t) => Ok((json!({ "name": t, "description": describe(t) }), 0)),
                None => Err(Problem::not_found(format!("help for `{other}`")).into()),
            },
        }
    }
}

impl ServerHandler for Gateway {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_server_info(
            Implementation::new("cynode-pm-gateway", env!("CARGO_PKG_VERSION")),
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let open = Map::from_iter([("type".to_string(), json!("object"))]);
        Ok(ListToolsResult::with_all_items(
            gateway::TOOLS
                .iter()
                .map(|t| Tool::new(*t, describe(t), open.clone()))
                .collect(),
        ))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let grant = context
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|p| p.extensions.get::<Grant>())
            .cloned();
        let Some(g) = grant else {
            return Err(ErrorData::invalid_request(
                "unauthorized",
                Some(json!({ "type": ProblemKind::Authentication.type_uri() })),
            ));
        };
        let args = request.arguments.unwrap_or_default();
        // A name that is not a tool name (a 12 MiB one…) goes no further than here: the
        // audit, the log and the reply name it `<invalid>`.
        let mut dest = None;
        let (tool, out) = if cynode_protocol::job::is_tool_name(&request.name) {
            let tool: &str = &request.name;
            (tool, self.run(&g, tool, &args, &mut dest).await)
        } else {
            (gateway::INVALID_TOOL, Err(invalid_name()))
        };
        let out = clipped(out);
        let entry = audit_entry(tool, &out, dest);
        tracing::info!(session_id = %g.session_id, task_id = %g.task_id, job_id = %g.job_id, tool = %entry.tool, outcome = %entry.outcome, bytes = entry.bytes,
            host = entry.host.as_deref().unwrap_or(""), port = entry.port.unwrap_or(0), decision = entry.decision.as_deref().unwrap_or(""),
            reason = entry.detail.as_deref().unwrap_or(""), "gateway call");
        gateway::tokens().audit(&g.job_id, entry);
        match out {
            Ok((v, _)) => Ok(reply(v).into()),
            Err(Refusal::Forbidden(d)) => Err(ErrorData::invalid_params(
                d.clone(),
                Some(json!({ "type": ProblemKind::Authorization.type_uri(), "detail": d })),
            )),
            Err(Refusal::BadArguments(d)) => Err(ErrorData::invalid_params(
                d.clone(),
                Some(json!({ "type": ProblemKind::Validation.type_uri(), "detail": d })),
            )),
            Err(Refusal::Problem(p)) => Ok(CallToolResult::structured_error(json!(p.0)).into()),
        }
    }
}

/// Largest result also given as text content; a larger one (an `artifact.get` of
/// megabytes) is in `structuredContent` only, with a short note as its text, so an 8 MiB
/// artifact (10.7 MiB of base64) is sent once and fits the 12 MiB reply caps of the
/// worker's forwarder and the SBA.
const MAX_TEXT_COPY_BYTES: usize = 64 << 10;

/// A tool's result: its JSON as `structuredContent`, and as text content too when small.
fn reply(v: Value) -> CallToolResult {
    let text = v.to_string();
    if text.len() <= MAX_TEXT_COPY_BYTES {
        return CallToolResult::structured(v);
    }
    let mut r = CallToolResult::success(vec![rmcp::model::ContentBlock::text(format!(
        "{} bytes of JSON in structuredContent",
        text.len()
    ))]);
    r.structured_content = Some(v);
    r
}

/// The gateway as a router to merge into the service's.
pub fn router<S: Clone + Send + Sync + 'static>(st: Arc<AppState>, max_body: usize) -> Router<S> {
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        .with_max_request_body_bytes(max_body)
        .disable_allowed_hosts()
        .with_cancellation_token(st.stop.child_token());
    let handler = Gateway { st };
    let service = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Arc::new(NeverSessionManager::default()),
        config,
    );
    Router::new()
        .nest_service(PATH, service)
        .layer(axum::middleware::from_fn(authenticate))
}

/// Admits a request with a live job token; the reason of a refusal names no token.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_string());
    let Some(token) = token else {
        return Problem::unauthorized().into_response();
    };
    match gateway::tokens().check(&token) {
        Ok(g) => {
            req.extensions_mut().insert(g);
            next.run(req).await
        }
        Err(e) => Problem::new(
            axum::http::StatusCode::UNAUTHORIZED,
            ProblemKind::Authentication,
            e.to_string(),
        )
        .into_response(),
    }
}

/// Bound on one request to a gateway hosted by [`host`] (`serve` uses its API's).
pub const HOSTED_REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// The gateway hosted by [`host`]; dropping it stops the listener.
#[derive(Debug)]
pub struct Hosted {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Hosted {
    fn drop(&mut self) {
        self.stop.cancel();
        self.task.abort();
    }
}

/// Serves the gateway alone on `listener` for the sessions `pm` drives in this process
/// (`cynode-pm run`): the same handler, tokens and audit as `serve`'s `/v1/gateway`,
/// through the same bounded accept loop (`cynode_tls::serve_with`, default listener
/// limits; HTTPS with `tls`, as `serve`'s), requests bounded by `max_body` and
/// [`HOSTED_REQUEST_TIMEOUT`]. `pm` must already carry the gateway's URL
/// (`Pm::gateway_url`) for its jobs to get tokens.
pub fn host(
    pm: Arc<crate::driver::Pm>,
    listener: std::net::TcpListener,
    max_body: usize,
    tls: Option<cynode_tls::ServerTls>,
) -> Hosted {
    let stop = tokio_util::sync::CancellationToken::new();
    let st = Arc::new(AppState {
        pm,
        tokens: crate::app::auth::Tokens::default(),
        wake: Arc::new(tokio::sync::Notify::new()),
        stop: stop.clone(),
    });
    let app: Router = router(st, max_body)
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            axum::http::StatusCode::REQUEST_TIMEOUT,
            HOSTED_REQUEST_TIMEOUT,
        ))
        .layer(tower_http::limit::RequestBodyLimitLayer::new(max_body));
    let done = stop.clone();
    let task = tokio::spawn(async move {
        let shutdown = async move { done.cancelled().await };
        if let Err(e) = cynode_tls::serve_with(
            listener,
            app,
            tls,
            cynode_tls::ListenerLimits::default(),
            shutdown,
        )
        .await
        {
            tracing::warn!(error = %e, "the session's gateway stopped");
        }
    });
    Hosted { stop, task }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hostile request's 1 MiB tool name or path stays out of the audit, the log and
    /// the reply: the name is `<invalid>` with a fixed refusal, a path is echoed in at
    /// most [`MAX_PATH_ECHO`] bytes, and any detail is cut to
    /// [`gateway::MAX_DETAIL_BYTES`].
    #[test]
    fn a_huge_name_or_path_is_not_kept_or_repeated() {
        let huge = "a".repeat(1 << 20);
        // The name: refused before any work, as call_tool does.
        assert!(!cynode_protocol::job::is_tool_name(&huge));
        let out = clipped(Err(invalid_name()));
        let e = audit_entry(gateway::INVALID_TOOL, &out, None);
        assert!(e.tool.len() <= 64, "{}", e.tool.len());
        assert_eq!(e.outcome, "refused");
        let d = e.detail.unwrap();
        assert!(d.len() <= 300 && !d.contains("aaaa"), "{d}");

        // The path.
        let Err(Refusal::BadArguments(m)) = check_path(&huge) else {
            panic!("a 1 MiB path was accepted");
        };
        assert!(m.len() < 300, "{}", m.len());
        let e = audit_entry(
            "artifact.put",
            &clipped(Err(Refusal::BadArguments(m))),
            None,
        );
        assert!(e.detail.unwrap().len() <= 300);

        // A big result goes once.
        let big = json!({ "content_base64": "A".repeat(1 << 20) });
        let r = serde_json::to_string(&reply(big)).unwrap();
        assert!(r.len() < (1 << 20) + 1024, "{} bytes", r.len());
        let small = serde_json::to_value(reply(json!({ "a": 1 }))).unwrap();
        assert_eq!(small["structuredContent"]["a"], 1);
        assert_eq!(small["content"][0]["text"], r#"{"a":1}"#);

        // Any other detail (an unknown field's name echoed by serde, a problem).
        let out = clipped(Err(Refusal::BadArguments(huge.clone())));
        let Err(Refusal::BadArguments(m)) = &out else {
            unreachable!()
        };
        assert!(m.len() <= 300, "the reply repeats {} bytes", m.len());
        assert!(audit_entry("skills.get", &out, None).detail.unwrap().len() <= 300);
        let p = Problem::not_found(huge.clone());
        let out = clipped(Err(Refusal::Problem(p)));
        assert!(
            audit_entry("artifact.get", &out, None)
                .detail
                .unwrap()
                .len()
                <= 300
        );
        // Multi-byte text is cut on a character boundary.
        assert!(gateway::clip(&"é".repeat(400), 300).len() <= 300);
    }
}
