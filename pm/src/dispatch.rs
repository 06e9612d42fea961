//! The PM's client of the Worker API: async submit (idempotent on job_id), status polling,
//! artifact download, ack, workspace changeset.
//!
//! Fail-fast classes: transport failures and 5xx answers are retried with exponential
//! backoff (every call here is idempotent); 401/403 is an authentication error naming the
//! worker, a failed TLS handshake (a worker certificate no configured CA issued, a client
//! certificate the worker refuses or lacks) a TLS error naming the worker and the
//! certificate problem, and any other 4xx a final refusal: none of these is retried, they
//! will not fix themselves.
//!
//! Every URL is built from the parsed base with `url`'s path-segment API, one segment per
//! id or path component, so job ids, workspace ids and artifact paths with spaces, `#`,
//! `?`, `%` or non-ASCII characters are percent-encoded and never read as a query or
//! fragment.
//!
//! A worker that speaks only upstream CyNodeAI's API (its capacity endpoint answers 404)
//! is remembered as such and driven through synchronous `jobs:run` behind the same calls
//! ([`upstream`] says what that fallback cannot give).

use std::sync::Arc;
use std::time::Duration;

pub mod passthrough;
pub mod upstream;

pub use upstream::Flavor;

use cynode_protocol::worker_api::{AsyncJobStatus, RunJobRequest, RunJobResponse, WorkerCapacity};
use cynode_protocol::worker_workspaces::CreateWorkspace;
use cynode_tls::ClientTls;
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
    /// 401/403: the worker does not accept this PM's token.
    #[error("worker {worker} refused our token ({status}): authentication failed; check the worker token")]
    Auth { worker: String, status: u16 },
    /// The TLS handshake failed: the worker's certificate is not trusted, or the worker
    /// refused (or missed) this PM's client certificate.
    #[error("worker {worker}: tls handshake failed: {detail}")]
    Tls { worker: String, detail: String },
    /// The worker endpoint is not a base URL.
    #[error("invalid worker endpoint `{endpoint}`: {reason}")]
    BadEndpoint { endpoint: String, reason: String },
}

impl DispatchError {
    /// Whether the same call may succeed later.
    pub fn is_retryable(&self) -> bool {
        match self {
            DispatchError::Unavailable(_) => true,
            DispatchError::Rejected { .. } => false,
            DispatchError::NotFound(_) => false,
            DispatchError::Auth { .. } => false,
            DispatchError::Tls { .. } => false,
            DispatchError::BadEndpoint { .. } => false,
        }
    }
}

/// A worker endpoint with its bearer token (never logged).
#[derive(Clone)]
pub struct WorkerClient {
    base: String,
    /// `base` parsed; an endpoint that is not a base URL fails every call.
    base_url: Result<url::Url, String>,
    token: String,
    http: reqwest::Client,
    /// How many times a retryable failure is retried.
    pub retries: u32,
    /// Polling interval bounds.
    pub poll: (Duration, Duration),
    /// What this worker speaks, and its synchronous jobs when it is upstream's.
    upstream: upstream::Shared,
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
    /// A client of `base` (e.g. `http://127.0.0.1:9190`) trusting the system's roots.
    pub fn new(base: &str, token: &str) -> Self {
        Self::with_tls(base, token, &ClientTls::default()).unwrap_or_else(|e| {
            // Unreachable with the default (no file is read); keep a working client.
            tracing::warn!(error = %e, "worker client without tls settings");
            Self::with_http(base, token, reqwest::Client::new())
        })
    }

    /// A client of `base` (`http://` or `https://`) that trusts `tls.ca_file` beside the
    /// system's roots and presents `tls.cert_file`/`tls.key_file` to a worker that
    /// requires client certificates.
    pub fn with_tls(
        base: &str,
        token: &str,
        tls: &ClientTls,
    ) -> Result<Self, cynode_tls::TlsError> {
        let http = tls
            .apply(reqwest::Client::builder().timeout(Duration::from_secs(60)))?
            .build()
            .map_err(|e| cynode_tls::TlsError::Config(e.to_string()))?;
        Ok(Self::with_http(base, token, http))
    }

    fn with_http(base: &str, token: &str, http: reqwest::Client) -> Self {
        let base = base.trim_end_matches('/').to_string();
        let base_url = url::Url::parse(&base)
            .map_err(|e| e.to_string())
            .and_then(|u| {
                if u.cannot_be_a_base() {
                    Err("not a base URL".to_string())
                } else {
                    Ok(u)
                }
            });
        WorkerClient {
            base,
            base_url,
            token: token.to_string(),
            http,
            retries: 6,
            poll: (Duration::from_millis(50), Duration::from_secs(1)),
            upstream: Arc::default(),
        }
    }

    /// One Worker API call with its retries, in a `worker_call` span (an OpenTelemetry
    /// client span) whose context goes to the worker as the W3C `traceparent` header
    /// when traces are exported.
    async fn call(
        &self,
        method: reqwest::Method,
        segments: &[&str],
        body: Option<&serde_json::Value>,
    ) -> Result<reqwest::Response, DispatchError> {
        self.call_url(method, self.url(segments)?, body).await
    }

    /// [`WorkerClient::call`] on a URL built by [`WorkerClient::url`].
    async fn call_url(
        &self,
        method: reqwest::Method,
        url: url::Url,
        body: Option<&serde_json::Value>,
    ) -> Result<reqwest::Response, DispatchError> {
        let path = url.path();
        let span = tracing::info_span!(
            "worker_call",
            otel.kind = "client",
            http.request.method = %method,
            url.path = path,
            http.response.status_code = tracing::field::Empty,
        );
        self.call_with_retries(method, &url, body, self.retries)
            .instrument(span)
            .await
    }

    /// The base URL with `segments` appended, each one percent-encoded as one path
    /// segment (a `/` inside a segment is encoded too).
    pub fn url(&self, segments: &[&str]) -> Result<url::Url, DispatchError> {
        let mut url = self
            .base_url
            .clone()
            .map_err(|reason| DispatchError::BadEndpoint {
                endpoint: self.base.clone(),
                reason,
            })?;
        {
            let mut path = url
                .path_segments_mut()
                .map_err(|()| DispatchError::BadEndpoint {
                    endpoint: self.base.clone(),
                    reason: "not a base URL".into(),
                })?;
            path.pop_if_empty();
            path.extend(segments);
        }
        Ok(url)
    }

    /// The base URL with the fixed segments `prefix`, then each `/`-separated component
    /// of the relative `path` as a segment of its own.
    fn url_with_path(&self, prefix: &[&str], path: &str) -> Result<url::Url, DispatchError> {
        let mut all: Vec<&str> = prefix.to_vec();
        all.extend(path.split('/').filter(|c| !c.is_empty()));
        self.url(&all)
    }

    async fn call_with_retries(
        &self,
        method: reqwest::Method,
        url: &url::Url,
        body: Option<&serde_json::Value>,
        retries: u32,
    ) -> Result<reqwest::Response, DispatchError> {
        let path = url.path();
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
                .request(method.clone(), url.clone())
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
                Ok(r) if matches!(r.status().as_u16(), 401 | 403) => {
                    return Err(DispatchError::Auth {
                        worker: self.base.clone(),
                        status: r.status().as_u16(),
                    })
                }
                Ok(r) if r.status().as_u16() == 404 => {
                    return Err(DispatchError::NotFound(path.to_string()))
                }
                Ok(r) if r.status().is_client_error() => {
                    let status = r.status().as_u16();
                    let detail = problem_detail(r).await;
                    return Err(DispatchError::Rejected { status, detail });
                }
                Ok(r) => return Ok(r),
                Err(e) => {
                    if let Some(detail) = tls_failure(&e) {
                        tracing::warn!(path, error = %detail, "tls handshake with the worker failed; not retrying");
                        return Err(DispatchError::Tls {
                            worker: self.base.clone(),
                            detail,
                        });
                    }
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

    /// [`WorkerClient::call`], its answer read as `T`.
    async fn call_json<T: serde::de::DeserializeOwned>(
        &self,
        method: reqwest::Method,
        segments: &[&str],
        body: Option<&serde_json::Value>,
    ) -> Result<T, DispatchError> {
        Self::json(self.call(method, segments, body).await?).await
    }

    /// The status of a job this PM process holds for upstream's worker.
    fn held_status(&self, job_id: &str) -> Result<AsyncJobStatus, DispatchError> {
        self.upstream.status("", job_id).unwrap_or_else(|| {
            Err(upstream::not_offered(&format!(
                "job {job_id} is not known to this PM process"
            )))
        })
    }

    /// The endpoint this client calls.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `GET /v1/worker/capacity`, asked once (placement skips a worker that does not
    /// answer rather than wait for it). A 404 marks the worker as upstream's, whose
    /// capacity is then synthesised (see [`upstream`]).
    pub async fn capacity(&self) -> Result<WorkerCapacity, DispatchError> {
        if self.upstream.flavor() == Some(Flavor::Upstream) {
            return Ok(self.upstream_capacity().await);
        }
        let url = self.url(&["v1", "worker", "capacity"])?;
        let answer = match self
            .call_with_retries(reqwest::Method::GET, &url, None, 0)
            .await
        {
            Err(DispatchError::NotFound(_)) => {
                self.upstream.set_flavor(Flavor::Upstream);
                return Ok(self.upstream_capacity().await);
            }
            other => other?,
        };
        let c: WorkerCapacity = Self::json(answer).await?;
        self.upstream.set_flavor(Flavor::Native);
        Ok(c)
    }

    /// The API this worker speaks, asking it (through its capacity endpoint) until it
    /// answers. A worker that does not answer yet counts as this project's, so the call
    /// that follows gets its usual retries.
    pub async fn flavor(&self) -> Flavor {
        if let Some(f) = self.upstream.flavor() {
            return f;
        }
        if let Err(e) = self.capacity().await {
            tracing::debug!(error = %e, "cannot tell which Worker API the worker speaks yet");
        }
        self.upstream.flavor().unwrap_or(Flavor::Native)
    }

    fn is_upstream(&self) -> bool {
        self.upstream.flavor() == Some(Flavor::Upstream)
    }

    async fn upstream_capacity(&self) -> WorkerCapacity {
        WorkerCapacity {
            version: cynode_protocol::worker_api::API_VERSION,
            backend: "upstream".into(),
            max_running: u64::from(u32::MAX),
            max_queued: 0,
            running: self.upstream.running(),
            queued: 0,
            ready: self.ready().await,
        }
    }

    /// An upstream worker's job: one synchronous `jobs:run` in a task of its own.
    fn upstream_submit(&self, req: &RunJobRequest) -> Result<AsyncJobStatus, DispatchError> {
        if let Some(known) = self.upstream.status(&req.task_id, &req.job_id) {
            return known;
        }
        let prepared = upstream::prepare(req);
        let this = self.clone();
        let req2 = req.clone();
        let job_id = req.job_id.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(
            async move {
                // Runs only once the slot is recorded, so its outcome always lands in it.
                if rx.await.is_err() {
                    return;
                }
                let outcome = match prepared {
                    Err(why) => {
                        tracing::warn!(job_id = %req2.job_id, why, "job refused for an upstream worker");
                        Ok(upstream::refused(&req2, why))
                    }
                    Ok(p) => this
                        .run_sync(&p.body, p.wait)
                        .await
                        .map(|r| upstream::adopt(r, &req2, &p.step_ids)),
                };
                this.upstream.finish(&req2.job_id, outcome);
            }
            .instrument(tracing::Span::current()),
        );
        if self.upstream.start(&job_id, task.abort_handle()) {
            let _ = tx.send(());
        }
        self.upstream
            .status(&req.task_id, &req.job_id)
            .unwrap_or_else(|| Err(DispatchError::Unavailable("job state lost".into())))
    }

    /// `POST /v1/worker/jobs:run`, waiting up to `wait`. Only a request that never
    /// reached the worker is sent again (anything else might run the job twice).
    async fn run_sync(
        &self,
        body: &serde_json::Value,
        wait: Duration,
    ) -> Result<RunJobResponse, DispatchError> {
        let url = self.url(&["v1", "worker", "jobs:run"])?;
        let path = url.path().to_string();
        let span = tracing::info_span!(
            "worker_call",
            otel.kind = "client",
            http.request.method = "POST",
            url.path = %path,
            http.response.status_code = tracing::field::Empty,
        );
        async {
            let traceparent = crate::telemetry::traceparent();
            let mut delay = Duration::from_millis(100);
            let mut attempt = 0;
            let r = loop {
                let mut req = self
                    .http
                    .post(url.clone())
                    .bearer_auth(&self.token)
                    .timeout(wait)
                    .json(body);
                if let Some(tp) = &traceparent {
                    req = req.header("traceparent", tp);
                }
                match req.send().await {
                    Ok(r) => break r,
                    Err(e) => {
                        if let Some(detail) = tls_failure(&e) {
                            return Err(DispatchError::Tls {
                                worker: self.base.clone(),
                                detail,
                            });
                        }
                        if !e.is_connect() || attempt >= self.retries {
                            return Err(DispatchError::Unavailable(format!("{}: {e}", self.base)));
                        }
                        tracing::warn!(path, attempt, error = %e, "worker unreachable; retrying");
                        attempt += 1;
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(5));
                    }
                }
            };
            let status = r.status().as_u16();
            tracing::Span::current().record("http.response.status_code", status);
            match status {
                200..=299 => Self::json(r).await,
                401 | 403 => Err(DispatchError::Auth {
                    worker: self.base.clone(),
                    status,
                }),
                404 => Err(DispatchError::NotFound(path.clone())),
                400..=499 => {
                    let detail = problem_detail(r).await;
                    Err(DispatchError::Rejected { status, detail })
                }
                _ => Err(DispatchError::Unavailable(format!(
                    "{} answered {status} to jobs:run",
                    self.base
                ))),
            }
        }
        .instrument(span)
        .await
    }

    /// `POST /v1/worker/jobs`: idempotent on job_id.
    pub async fn submit(&self, req: &RunJobRequest) -> Result<AsyncJobStatus, DispatchError> {
        if self.flavor().await == Flavor::Upstream {
            return self.upstream_submit(req);
        }
        match self.submit_async(req).await {
            // A worker that was down when first asked may be upstream's after all.
            Err(DispatchError::NotFound(_))
                if self.upstream.flavor().is_none() && self.flavor().await == Flavor::Upstream =>
            {
                self.upstream_submit(req)
            }
            other => other,
        }
    }

    async fn submit_async(&self, req: &RunJobRequest) -> Result<AsyncJobStatus, DispatchError> {
        let body =
            serde_json::to_value(req).map_err(|e| DispatchError::Unavailable(e.to_string()))?;
        self.call_json(
            reqwest::Method::POST,
            &["v1", "worker", "jobs"],
            Some(&body),
        )
        .await
    }

    /// `GET /v1/worker/jobs/{id}`.
    pub async fn status(&self, job_id: &str) -> Result<AsyncJobStatus, DispatchError> {
        if self.is_upstream() {
            return self.held_status(job_id);
        }
        self.call_json(
            reqwest::Method::GET,
            &["v1", "worker", "jobs", job_id],
            None,
        )
        .await
    }

    /// `POST /v1/worker/jobs/{id}:stop`: stops a queued or running job (idempotent).
    pub async fn stop(&self, job_id: &str) -> Result<AsyncJobStatus, DispatchError> {
        if self.is_upstream() {
            self.upstream.cancel(job_id);
            return self.held_status(job_id);
        }
        self.call_json(
            reqwest::Method::POST,
            &["v1", "worker", "jobs", &format!("{job_id}:stop")],
            Some(&serde_json::json!({})),
        )
        .await
    }

    /// The bytes of one artifact.
    pub async fn artifact(&self, job_id: &str, path: &str) -> Result<Vec<u8>, DispatchError> {
        if self.is_upstream() {
            return Err(upstream::not_offered(&format!(
                "artifact download of {path}"
            )));
        }
        let url = self.url_with_path(&["v1", "worker", "jobs", job_id, "artifacts"], path)?;
        let r = self.call_url(reqwest::Method::GET, url, None).await?;
        r.bytes()
            .await
            .map(|b| b.to_vec())
            .map_err(|e| DispatchError::Unavailable(format!("artifact download broke: {e}")))
    }

    /// Tells the worker it may delete the job's result.
    pub async fn ack(&self, job_id: &str) -> Result<(), DispatchError> {
        if self.is_upstream() {
            self.upstream.forget(job_id);
            return Ok(());
        }
        self.call(
            reqwest::Method::POST,
            &["v1", "worker", "jobs", &format!("{job_id}:ack")],
            Some(&serde_json::json!({})),
        )
        .await?;
        Ok(())
    }

    /// `GET /readyz` answers 200.
    pub async fn ready(&self) -> bool {
        let Ok(url) = self.url(&["readyz"]) else {
            return false;
        };
        self.http
            .get(url)
            .send()
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false)
    }

    /// The workspace's changes as a git diff (empty when nothing changed).
    pub async fn changeset(&self, workspace_id: &str) -> Result<String, DispatchError> {
        if self.is_upstream() {
            return Err(upstream::not_offered("workspace changesets"));
        }
        let r = self
            .call(
                reqwest::Method::GET,
                &["v1", "worker", "workspaces", workspace_id, "changeset"],
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
        if self.flavor().await == Flavor::Upstream {
            // Upstream gives every job a fresh workspace of its own: nothing to create,
            // and nothing a seed could go into.
            return match seed_from {
                None => Ok(()),
                Some(dir) => Err(DispatchError::Rejected {
                    status: 501,
                    detail: format!(
                        "the worker speaks only upstream CyNodeAI's Worker API, which has no workspaces: cannot seed from {}",
                        dir.display()
                    ),
                }),
            };
        }
        let body = serde_json::to_value(CreateWorkspace {
            version: 1,
            workspace_id: workspace_id.to_string(),
            seed_from: seed_from.map(std::path::Path::to_path_buf),
        })
        .unwrap_or_default();
        self.call(
            reqwest::Method::POST,
            &["v1", "worker", "workspaces"],
            Some(&body),
        )
        .await?;
        Ok(())
    }
}

/// The `detail` of a worker's problem+json answer (`protocol::problem::Problem`), or ""
/// when the body is not one (a peer's error bodies are read tolerantly: only `detail`).
async fn problem_detail(r: reqwest::Response) -> String {
    #[derive(serde::Deserialize)]
    struct Detail {
        detail: Option<String>,
    }
    r.json::<Detail>()
        .await
        .ok()
        .and_then(|d| d.detail)
        .unwrap_or_default()
}

/// The TLS problem behind a failed request, in words, or `None` when it failed otherwise
/// (refused connection, timeout…: those may pass).
pub fn tls_failure(e: &reqwest::Error) -> Option<String> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = next {
        if let Some(r) = err.downcast_ref::<rustls::Error>() {
            return Some(describe_tls(r));
        }
        // io::Error::source skips the error it wraps (itself often an io::Error around
        // the rustls error, when connecting): go into it instead.
        next = match err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    None
}

fn describe_tls(e: &rustls::Error) -> String {
    use rustls::{AlertDescription as A, CertificateError as C, Error as E};
    match e {
        E::InvalidCertificate(C::UnknownIssuer) => format!(
            "the worker's certificate is not issued by a trusted CA (give its CA as ca_file / --worker-ca-file) ({e})"
        ),
        E::InvalidCertificate(_) => format!("the worker's certificate is not valid here ({e})"),
        E::AlertReceived(A::CertificateRequired) => format!(
            "the worker requires a client certificate and none was presented (give cert_file and key_file / --worker-client-cert and --worker-client-key) ({e})"
        ),
        E::AlertReceived(
            A::UnknownCA
            | A::BadCertificate
            | A::UnsupportedCertificate
            | A::CertificateRevoked
            | A::CertificateExpired
            | A::CertificateUnknown
            | A::AccessDenied
            | A::DecryptError,
        ) => format!("the worker refused this PM's client certificate ({e})"),
        _ => format!("{e}"),
    }
}
