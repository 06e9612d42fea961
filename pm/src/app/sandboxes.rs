//! The sandbox operations behind `/v1/sandboxes…` and the `sandbox.*` MCP tools: a
//! worker's session (exec, streamed execs that reattach, files, suspend and resume,
//! snapshots and forks) offered to a tenant under the tenant's policy.
//!
//! - **Ownership.** The PM names each sandbox (`sb-` and a random UUID) and records its
//!   tenant and worker before the worker creates it; every later call checks that record,
//!   so another tenant's sandbox or snapshot is "not found", exactly like a missing one.
//!   Snapshots are recorded as the tenant's when the worker answers their creation; a fork
//!   or a delete of an unrecorded snapshot id is "not found" too. On the worker every
//!   sandbox of a tenant has the tenant's task (`tenant-` and a hash of the tenant), so
//!   the worker's own check keeps forks within a tenant as well.
//! - **Policy.** A create is checked against the tenant's policy before anything is
//!   placed: the purpose (`allowed_purposes`), the image the worker offers for it
//!   (`allowed_images`), the network (`allow_network` or a non-empty `egress.allow`;
//!   `egress_allow` within `egress.allow`; `allow` refused) and the lifetime
//!   (`max_runtime_seconds`).
//! - **Answers.** After the create, the worker's answer is handed on as it is: its status,
//!   its body streamed (an exec's output is a stream), only its content type kept. A 5xx
//!   of the worker becomes a 502 naming the worker, its detail only in the PM's log.

use sha2::{Digest, Sha256};

use cynode_protocol::pm_sandboxes::{CreateSandbox, SandboxList, SandboxRef};
use cynode_protocol::worker_api::NetworkPolicy;
use cynode_protocol::worker_sessions::CreateSessionRequest;

use super::auth::Tenant;
use super::problem::Problem;
use super::AppState;
use crate::dispatch::passthrough::Forward;
use crate::dispatch::{DispatchError, WorkerClient};
use crate::store::Owner;

/// The purpose of a sandbox that names none.
pub const DEFAULT_PURPOSE: &str = "base-tools";
/// Lifetime of a sandbox that names none (capped by the tenant's `max_runtime_seconds`).
const DEFAULT_LIFETIME_SECONDS: u64 = 3600;
/// At most this many sandboxes are listed.
const LIST_LIMIT: i64 = 1000;

/// The worker task of every sandbox of `tenant`: stable per tenant, never the tenant's
/// name itself (which the worker would otherwise log and show).
pub fn tenant_task(tenant: &str) -> String {
    let d = Sha256::digest(format!("cynode-pm sandbox tenant\n{tenant}").as_bytes());
    format!("tenant-{}", &hex::encode(d)[..24])
}

/// The owner of the tenant's sandbox `id`; "not found" for another tenant's or an
/// unknown id.
pub async fn owned(st: &AppState, tenant: &Tenant, id: &str) -> Result<Owner, Problem> {
    let not_found = || Problem::not_found(format!("sandbox {id}"));
    let owner = st.pm.store.sandbox_owner(id).await?.ok_or_else(not_found)?;
    if owner.tenant_id != tenant.0 {
        return Err(not_found());
    }
    Ok(owner)
}

fn worker<'a>(st: &'a AppState, worker_id: &str) -> Result<&'a WorkerClient, Problem> {
    st.pm
        .workers
        .client(worker_id)
        .ok_or_else(|| Problem::unavailable(format!("worker {worker_id} is not registered")))
}

/// The tenant's snapshot `id` and its owner record; "not found" otherwise.
async fn owned_snapshot(st: &AppState, tenant: &Tenant, id: &str) -> Result<Owner, Problem> {
    let not_found = || Problem::not_found(format!("snapshot {id}"));
    let owner = st
        .pm
        .store
        .snapshot_owner(id)
        .await?
        .ok_or_else(not_found)?;
    if owner.tenant_id != tenant.0 {
        return Err(not_found());
    }
    Ok(owner)
}

/// What a create is refused for by the tenant's policy, before placement.
fn check_policy(st: &AppState, req: &CreateSandbox) -> Result<(u64, Option<Vec<String>>), Problem> {
    let t = &st.pm.tenant;
    let purpose = req.purpose.as_deref().unwrap_or(DEFAULT_PURPOSE);
    if !t.allowed_purposes.is_empty() && !t.allowed_purposes.iter().any(|p| p == purpose) {
        return Err(Problem::forbidden(format!(
            "purpose: `{purpose}` is not in the tenant's allowed_purposes"
        )));
    }
    let egress = match req.network_policy.unwrap_or_default() {
        NetworkPolicy::None => {
            if req.egress_allow.is_some() {
                return Err(Problem::bad_request(
                    "egress_allow: only with network_policy: restricted",
                ));
            }
            None
        }
        NetworkPolicy::Allow => {
            return Err(Problem::bad_request(
                "network_policy: `allow` is never offered; use `restricted` (the worker's egress proxy)",
            ))
        }
        NetworkPolicy::Restricted => {
            if !t.allow_network && t.egress.allow.is_empty() {
                return Err(Problem::forbidden(
                    "network_policy: the tenant's sandboxes have no network (allow_network, egress.allow)",
                ));
            }
            match &req.egress_allow {
                Some(list) if !t.egress.allow.is_empty() => {
                    if let Some(bad) = list.iter().find(|e| !t.egress.allow.contains(e)) {
                        return Err(Problem::forbidden(format!(
                            "egress_allow: `{bad}` is not in the tenant's egress.allow"
                        )));
                    }
                    Some(list.clone())
                }
                Some(list) => Some(list.clone()),
                None if !t.egress.allow.is_empty() => Some(t.egress.allow.clone()),
                None => None,
            }
        }
    };
    let ceiling = t.max_runtime_seconds;
    let lifetime = match req.max_lifetime_seconds {
        Some(0) => {
            return Err(Problem::bad_request(
                "max_lifetime_seconds: must be at least 1",
            ))
        }
        Some(s) if s > ceiling => {
            return Err(Problem::bad_request(format!(
                "max_lifetime_seconds: {s} is over the tenant's max_runtime_seconds ({ceiling})"
            )))
        }
        Some(s) => s,
        None => DEFAULT_LIFETIME_SECONDS.min(ceiling),
    };
    Ok((lifetime, egress))
}

/// Whether the tenant may run `image` (`allowed_images`: exact, or a prefix ending in `*`;
/// empty: any), as the job policy judges a job's image.
fn image_allowed(patterns: &[String], image: &str) -> bool {
    patterns.is_empty()
        || patterns.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => image.starts_with(prefix),
            None => p == image,
        })
}

/// Creates a sandbox for `tenant` (a fork when `from_snapshot` names one of its
/// snapshots) and returns the worker's answer.
pub async fn create(
    st: &AppState,
    tenant: &Tenant,
    req: &CreateSandbox,
) -> Result<reqwest::Response, Problem> {
    let (lifetime, egress_allow) = check_policy(st, req)?;
    let purpose = req.purpose.as_deref().unwrap_or(DEFAULT_PURPOSE);
    let placement = match &req.from_snapshot {
        Some(snap) => {
            let owner = owned_snapshot(st, tenant, snap).await?;
            st.pm.workers.pinned(&owner.worker_id, purpose)
        }
        None => st.pm.workers.place(purpose).await,
    }
    .map_err(|e| Problem::unavailable(e.to_string()))?;
    if !image_allowed(&st.pm.tenant.allowed_images, &placement.image) {
        return Err(Problem::forbidden(format!(
            "purpose `{purpose}` runs image `{}`, which is not in the tenant's allowed_images",
            placement.image
        )));
    }
    let client = worker(st, &placement.worker_id)?;
    let id = format!("sb-{}", uuid::Uuid::new_v4());
    let owner = Owner {
        tenant_id: tenant.0.clone(),
        worker_id: placement.worker_id.clone(),
    };
    // Recorded first: a sandbox on a worker always has its owner here.
    st.pm.store.put_sandbox(&id, &owner).await?;
    let body = CreateSessionRequest {
        version: 1,
        session_id: id.clone(),
        task_id: tenant_task(&tenant.0),
        image: placement.image.clone(),
        workspace_id: Some(id.clone()),
        idle_timeout_seconds: req.idle_timeout_seconds,
        max_lifetime_seconds: Some(lifetime),
        env: req.env.clone(),
        network_policy: req.network_policy,
        egress_allow,
        use_inference: req.use_inference,
        on_idle: req.on_idle,
        from_snapshot: req.from_snapshot.clone(),
    };
    let body = serde_json::to_vec(&body).map_err(|e| Problem::internal(e.to_string()))?;
    let answer = client
        .forward(Forward {
            method: reqwest::Method::POST,
            segments: &["v1", "worker", "sessions"],
            query: &[],
            headers: &[],
            body: Some((body.into(), "application/json")),
            stream: false,
        })
        .await;
    tracing::info!(sandbox_id = %id, tenant = %tenant.0, worker = %placement.worker_id,
        purpose, fork = req.from_snapshot.is_some(), "sandbox create");
    let answer = checked(&placement.worker_id, answer);
    if !answer.as_ref().is_ok_and(|r| r.status().is_success()) {
        // Refused or failed: no sandbox to own (a worker that failed mid-create ends an
        // orphan session by its own timeouts).
        st.pm.store.forget_sandbox(&id).await?;
    }
    answer
}

/// The tenant's sandboxes.
pub async fn list(st: &AppState, tenant: &Tenant) -> Result<SandboxList, Problem> {
    let ids = st.pm.store.tenant_sandboxes(&tenant.0, LIST_LIMIT).await?;
    let mut sandboxes = Vec::with_capacity(ids.len());
    for id in ids {
        if let Some(o) = st.pm.store.sandbox_owner(&id).await? {
            sandboxes.push(SandboxRef {
                sandbox_id: id,
                worker_id: o.worker_id,
            });
        }
    }
    Ok(SandboxList { sandboxes })
}

/// One call on the tenant's sandbox `id`: `path` below `/v1/worker/sessions/{id}` (empty:
/// the session itself; `suffix` is appended to the id segment, e.g. `:suspend`).
#[derive(Debug)]
pub struct Call<'a> {
    pub method: reqwest::Method,
    pub suffix: &'a str,
    pub path: &'a [&'a str],
    pub query: &'a [(&'a str, String)],
    pub headers: &'a [(&'static str, String)],
    pub body: Option<(reqwest::Body, &'static str)>,
    pub stream: bool,
}

impl Call<'_> {
    /// A call without query, headers or body.
    pub fn simple<'a>(method: reqwest::Method, suffix: &'a str, path: &'a [&'a str]) -> Call<'a> {
        Call {
            method,
            suffix,
            path,
            query: &[],
            headers: &[],
            body: None,
            stream: false,
        }
    }
}

/// Sends `call` to the worker of the tenant's sandbox `id`.
pub async fn call(
    st: &AppState,
    tenant: &Tenant,
    id: &str,
    call: Call<'_>,
) -> Result<reqwest::Response, Problem> {
    let owner = owned(st, tenant, id).await?;
    let client = worker(st, &owner.worker_id)?;
    let head = format!("{id}{}", call.suffix);
    let mut segments = vec!["v1", "worker", "sessions", head.as_str()];
    segments.extend_from_slice(call.path);
    tracing::info!(sandbox_id = %id, tenant = %tenant.0, method = %call.method,
        op = %format!("{}{}", call.suffix, call.path.join("/")), "sandbox call");
    let answer = client
        .forward(Forward {
            method: call.method,
            segments: &segments,
            query: call.query,
            headers: call.headers,
            body: call.body,
            stream: call.stream,
        })
        .await;
    checked(&owner.worker_id, answer)
}

/// Snapshots the tenant's sandbox `id` and records the snapshot as the tenant's; the
/// worker's `SnapshotInfo` as JSON.
pub async fn snapshot(
    st: &AppState,
    tenant: &Tenant,
    id: &str,
) -> Result<(u16, serde_json::Value), Problem> {
    let answer = call(
        st,
        tenant,
        id,
        Call::simple(reqwest::Method::POST, "", &["snapshots"]),
    )
    .await?;
    let status = answer.status().as_u16();
    let v = read_json(answer).await?;
    if (200..300).contains(&status) {
        let snap = v["snapshot_id"].as_str().unwrap_or_default();
        if snap.is_empty() {
            return Err(Problem::status(
                axum::http::StatusCode::BAD_GATEWAY,
                "the worker's snapshot answer names no snapshot_id",
            ));
        }
        let owner = owned(st, tenant, id).await?;
        st.pm.store.put_snapshot(snap, id, &owner).await?;
        tracing::info!(sandbox_id = %id, snapshot_id = %snap, tenant = %tenant.0, "sandbox snapshot");
    }
    Ok((status, v))
}

/// Deletes the tenant's snapshot `id` on its worker and forgets it.
pub async fn delete_snapshot(
    st: &AppState,
    tenant: &Tenant,
    id: &str,
) -> Result<reqwest::Response, Problem> {
    let owner = owned_snapshot(st, tenant, id).await?;
    let client = worker(st, &owner.worker_id)?;
    let answer = client
        .forward(Forward {
            method: reqwest::Method::DELETE,
            segments: &["v1", "worker", "snapshots", id],
            query: &[],
            headers: &[],
            body: None,
            stream: false,
        })
        .await;
    let answer = checked(&owner.worker_id, answer)?;
    if answer.status().is_success() || answer.status().as_u16() == 404 {
        st.pm.store.forget_snapshot(id).await?;
    }
    tracing::info!(snapshot_id = %id, tenant = %tenant.0, status = answer.status().as_u16(), "sandbox snapshot delete");
    Ok(answer)
}

/// A worker's answer, or the problem a failed call or a 5xx answer is.
fn checked(
    worker_id: &str,
    answer: Result<reqwest::Response, DispatchError>,
) -> Result<reqwest::Response, Problem> {
    match answer {
        Ok(r) if r.status().is_server_error() => {
            tracing::warn!(worker = %worker_id, status = r.status().as_u16(), "sandbox call: the worker failed");
            Err(Problem::status(
                axum::http::StatusCode::BAD_GATEWAY,
                format!(
                    "worker {worker_id} failed ({}); its detail is in the PM's log",
                    r.status().as_u16()
                ),
            ))
        }
        Ok(r) => Ok(r),
        Err(e) => {
            tracing::warn!(worker = %worker_id, error = %e, "sandbox call: the worker is unavailable");
            Err(Problem::unavailable(format!("worker {worker_id}: {e}")))
        }
    }
}

/// The largest answer read whole (everything but an exec's output and a file's bytes).
pub const JSON_ANSWER_MAX: usize = 1024 * 1024;

/// Reads a worker's JSON answer, at most [`JSON_ANSWER_MAX`] bytes.
pub async fn read_json(r: reqwest::Response) -> Result<serde_json::Value, Problem> {
    let bytes = read_bounded(r, JSON_ANSWER_MAX).await?;
    serde_json::from_slice(&bytes).map_err(|e| {
        Problem::status(
            axum::http::StatusCode::BAD_GATEWAY,
            format!("the worker's answer is not JSON: {e}"),
        )
    })
}

/// Reads a worker's answer body, refusing one over `max` bytes.
pub async fn read_bounded(mut r: reqwest::Response, max: usize) -> Result<Vec<u8>, Problem> {
    let mut out = Vec::new();
    loop {
        match r.chunk().await {
            Ok(Some(c)) => {
                if out.len() + c.len() > max {
                    return Err(Problem::status(
                        axum::http::StatusCode::BAD_GATEWAY,
                        format!("the worker's answer is over {max} bytes"),
                    ));
                }
                out.extend_from_slice(&c);
            }
            Ok(None) => return Ok(out),
            Err(e) => {
                return Err(Problem::status(
                    axum::http::StatusCode::BAD_GATEWAY,
                    format!("the worker's answer broke off: {e}"),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenants_task_is_stable_and_hides_the_name() {
        assert_eq!(tenant_task("acme"), tenant_task("acme"));
        assert_ne!(tenant_task("acme"), tenant_task("globex"));
        assert!(!tenant_task("acme").contains("acme"));
        assert_eq!(tenant_task("acme").len(), "tenant-".len() + 24);
    }

    #[test]
    fn images_match_exactly_or_by_prefix() {
        let p = vec!["localhost/cynode-*".to_string(), "docker.io/x:1".into()];
        assert!(image_allowed(&p, "localhost/cynode-sba-test:latest"));
        assert!(image_allowed(&p, "docker.io/x:1"));
        assert!(!image_allowed(&p, "docker.io/x:2"));
        assert!(image_allowed(&[], "anything"));
    }
}
