//! The PM's client of the Worker API: async submit (idempotent on job_id), status polling,
//! artifact download, ack, workspace changeset. Transport failures and 5xx/503 answers are
//! retried with exponential backoff: every call here is idempotent.

use std::time::Duration;

use cynode_protocol::worker_api::{AsyncJobStatus, RunJobRequest, WorkerCapacity};
use tracing::Instrument;

/// Why a worker call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DispatchError {
    #[error("worker unavailable: {0}")]
    Unavailable(String),
    #[error("worker refused ({status}): {detail}")]
    Rejected { status: u16, detail: String },
    #[error("not found on the worker: {0}")]
    NotFound(String),
}

impl DispatchError {
    /// Whether the same call may succeed later.
    pub fn is_retryable(&self) -> bool {
        match self {
            DispatchError::Unavailable(_) => true,
            DispatchError::Rejected { .. } => false,
            DispatchError::NotFound(_) => false,
        }
    }
}

/// A worker endpoint with its bearer token (never logged).
#[derive(Clone)]
pub struct WorkerClient {
    base: String,
    token: String,
    http: reqwest::Client,
    /// How many times a retryable failure is retried.
    pub retries: u32,
    /// Polling interval bounds.
    pub poll: (Duration, Duration),
}

impl std::fmt::Debug for WorkerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerClient")
            .field("base", &self.base)
            .field("token", &"<redacted>")
            .finish()
    }
}

impl WorkerClient {
    /// A client of `base` (e.g. `http://127.0.0.1:9190`).
    pub fn new(base: &str, token: &str) -> Self {
        WorkerClient {
            base: base.trim_end_matches('/').to_string(),
            token: token.to_string(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap_or_default(),
            retries: 6,
            poll: (Duration::from_millis(50), Duration::from_secs(1)),
        }
    }

    /// One Worker API call with its retries, in a `worker_call` span (an OpenTelemetry
    /// client span) whose context goes to the worker as the W3C `traceparent` header
    /// when traces are exported.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<reqwest::Response, DispatchError> {
        let span = tracing::info_span!(
            "worker_call",
            otel.kind = "client",
            http.request.method = %method,
            url.path = path,
            http.response.status_code = tracing::field::Empty,
        );
        self.call_with_retries(method, path, body, self.retries)
            .instrument(span)
            .await
    }

    async fn call_with_retries(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&serde_json::Value>,
        retries: u32,
    ) -> Result<reqwest::Response, DispatchError> {
        let traceparent = crate::telemetry::traceparent();
        let mut delay = Duration::from_millis(100);
        let mut last = String::new();
        for attempt in 0..=retries {
            if attempt > 0 {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            let mut req = self
                .http
                .request(method.clone(), format!("{}{path}", self.base))
                .bearer_auth(&self.token);
            if let Some(tp) = &traceparent {
                req = req.header("traceparent", tp);
            }
            if let Some(b) = body {
                req = req.json(b);
            }
            let sent = req.send().await;
            if let Ok(r) = &sent {
                let status = r.status().as_u16();
                tracing::Span::current().record("http.response.status_code", status);
                tracing::debug!(method = %method, path, status, attempt, "worker answered");
            }
            match sent {
                Ok(r) if r.status().is_server_error() => {
                    last = format!("{} answered {}", self.base, r.status());
                    tracing::warn!(
                        path,
                        status = r.status().as_u16(),
                        attempt,
                        "worker error; retrying"
                    );
                }
                Ok(r) if r.status().as_u16() == 404 => {
                    return Err(DispatchError::NotFound(path.to_string()))
                }
                Ok(r) if r.status().is_client_error() => {
                    let status = r.status().as_u16();
                    let detail = r
                        .json::<serde_json::Value>()
                        .await
                        .ok()
                        .and_then(|v| v["detail"].as_str().map(str::to_string))
                        .unwrap_or_default();
                    return Err(DispatchError::Rejected { status, detail });
                }
                Ok(r) => return Ok(r),
                Err(e) => {
                    last = format!("{}: {e}", self.base);
                    tracing::warn!(path, attempt, error = %e, "worker unreachable; retrying");
                }
            }
        }
        Err(DispatchError::Unavailable(last))
    }

    async fn json<T: serde::de::DeserializeOwned>(
        r: reqwest::Response,
    ) -> Result<T, DispatchError> {
        r.json::<T>()
            .await
            .map_err(|e| DispatchError::Unavailable(format!("unreadable worker answer: {e}")))
    }

    /// The endpoint this client calls.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `GET /v1/worker/capacity`, asked once (placement skips a worker that does not
    /// answer rather than wait for it).
    pub async fn capacity(&self) -> Result<WorkerCapacity, DispatchError> {
        Self::json(
            self.call_with_retries(reqwest::Method::GET, "/v1/worker/capacity", None, 0)
                .await?,
        )
        .await
    }

    /// `POST /v1/worker/jobs`: idempotent on job_id.
    pub async fn submit(&self, req: &RunJobRequest) -> Result<AsyncJobStatus, DispatchError> {
        let body =
            serde_json::to_value(req).map_err(|e| DispatchError::Unavailable(e.to_string()))?;
        Self::json(
            self.call(reqwest::Method::POST, "/v1/worker/jobs", Some(&body))
                .await?,
        )
        .await
    }

    /// `GET /v1/worker/jobs/{id}`.
    pub async fn status(&self, job_id: &str) -> Result<AsyncJobStatus, DispatchError> {
        Self::json(
            self.call(
                reqwest::Method::GET,
                &format!("/v1/worker/jobs/{job_id}"),
                None,
            )
            .await?,
        )
        .await
    }

    /// `POST /v1/worker/jobs/{id}:stop`: stops a queued or running job (idempotent).
    pub async fn stop(&self, job_id: &str) -> Result<AsyncJobStatus, DispatchError> {
        Self::json(
            self.call(
                reqwest::Method::POST,
                &format!("/v1/worker/jobs/{job_id}:stop"),
                Some(&serde_json::json!({})),
            )
            .await?,
        )
        .await
    }

    /// The bytes of one artifact.
    pub async fn artifact(&self, job_id: &str, path: &str) -> Result<Vec<u8>, DispatchError> {
        let r = self
            .call(
                reqwest::Method::GET,
                &format!("/v1/worker/jobs/{job_id}/artifacts/{path}"),
                None,
            )
            .await?;
        r.bytes()
            .await
            .map(|b| b.to_vec())
            .map_err(|e| DispatchError::Unavailable(format!("artifact download broke: {e}")))
    }

    /// Tells the worker it may delete the job's result.
    pub async fn ack(&self, job_id: &str) -> Result<(), DispatchError> {
        self.call(
            reqwest::Method::POST,
            &format!("/v1/worker/jobs/{job_id}:ack"),
            Some(&serde_json::json!({})),
        )
        .await?;
        Ok(())
    }

    /// `GET /readyz` answers 200.
    pub async fn ready(&self) -> bool {
        self.http
            .get(format!("{}/readyz", self.base))
            .send()
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false)
    }

    /// The workspace's changes as a git diff (empty when nothing changed).
    pub async fn changeset(&self, workspace_id: &str) -> Result<String, DispatchError> {
        let r = self
            .call(
                reqwest::Method::GET,
                &format!("/v1/worker/workspaces/{workspace_id}/changeset"),
                None,
            )
            .await?;
        r.text()
            .await
            .map_err(|e| DispatchError::Unavailable(e.to_string()))
    }

    /// Creates the session's workspace, seeded from a host directory the worker allows.
    pub async fn create_workspace(
        &self,
        workspace_id: &str,
        seed_from: Option<&std::path::Path>,
    ) -> Result<(), DispatchError> {
        let mut body = serde_json::json!({ "version": 1, "workspace_id": workspace_id });
        if let Some(dir) = seed_from {
            body["seed_from"] = serde_json::json!(dir);
        }
        self.call(reqwest::Method::POST, "/v1/worker/workspaces", Some(&body))
            .await?;
        Ok(())
    }
}
