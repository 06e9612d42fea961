//! The worker registry: the Worker API nodes this PM may send jobs to, what each offers,
//! and where the next job goes.
//!
//! A registry is a YAML file (`--workers-file`), or one node given by `--worker-endpoint`
//! (offering every purpose with `--sandbox-image`), or the local worker `cynode-pm run`
//! starts. Each entry names its endpoint, where its bearer token comes from (a file or an
//! environment variable: never the file itself), the sandbox purposes it offers with the
//! image that serves each (`"*"` offers any purpose), a capacity and free-form labels.
//!
//! Transport: an `https://` endpoint is reached over rustls, trusting the system's roots
//! and the entry's `tls.ca_file`, presenting `tls.cert_file`/`tls.key_file` to a worker
//! that requires client certificates. Plain `http://` carries the bearer token in clear,
//! so it is accepted only to a loopback host (127.0.0.0/8, ::1, localhost) unless the
//! entry sets `allow_plain_http: true` (a private network the operator vouches for).
//!
//! Placement rules (see ARCHITECTURE.md):
//! - a session's workspace lives on one worker, so the session's first job places it
//!   ([`WorkerPool::place`]) and every later job goes to that worker ([`WorkerPool::pinned`]);
//! - placement considers only workers offering the skill's purpose, asks each for its live
//!   load (`GET /v1/worker/capacity`, which counts the jobs of every PM replica) and picks
//!   the most free capacity (`capacity − running − queued`); ties go to the worker this
//!   process placed fewest jobs on, then to the first in the file;
//! - a worker that does not answer, or answers not ready, is skipped and marked down with
//!   an exponential backoff (1 s doubling to 30 s); it is asked again once that passes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cynode_protocol::worker_api::WorkerCapacity;
use cynode_tls::ClientTls;
use serde::{Deserialize, Serialize};

use crate::dispatch::{DispatchError, WorkerClient};
use crate::settings_file::FileError;

/// Offers every purpose.
pub const ANY_PURPOSE: &str = "*";

/// Backoff of a worker that did not answer: first and largest.
const DOWN_FIRST: Duration = Duration::from_secs(1);
const DOWN_MAX: Duration = Duration::from_secs(30);

/// How long a capacity probe may take before the worker counts as unreachable.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The workers file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkersFile {
    pub workers: Vec<WorkerEntry>,
}

/// One worker of the registry.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerEntry {
    /// Stable name, recorded in sessions (`[a-z0-9-]+`).
    pub id: String,
    /// `https://host:port` of its Worker API (`http://` only to loopback, or with
    /// `allow_plain_http`).
    pub endpoint: String,
    /// What the PM trusts and presents over `https://`: `ca_file` (beside the system's
    /// roots), `cert_file` and `key_file` (its client certificate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ClientTls>,
    /// Allows a plain `http://` endpoint on a non-loopback host (the token then crosses
    /// the network in clear).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_plain_http: bool,
    /// File holding its bearer token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// Environment variable holding its bearer token (when there is no `token_file`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_env: Option<String>,
    /// Sandbox purpose (a skill's `purpose`) → the image its jobs run in; `"*"` = any.
    pub purposes: BTreeMap<String, String>,
    /// Jobs (running and queued) it should hold at most; more still go to the worker
    /// with the most room when every candidate is full (the worker queues or answers 503).
    #[serde(default = "default_capacity")]
    pub capacity: u64,
    /// Free-form labels (zone, hardware…), shown in logs and metrics.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

fn default_capacity() -> u64 {
    4
}

impl WorkerEntry {
    /// The image for `purpose`, when this worker offers it.
    pub fn image_for(&self, purpose: &str) -> Option<&str> {
        self.purposes
            .get(purpose)
            .or_else(|| self.purposes.get(ANY_PURPOSE))
            .map(String::as_str)
    }

    fn check(&self) -> Result<(), String> {
        if !crate::skills::manifest::is_id(&self.id) {
            return Err(format!(
                "id `{}`: use lowercase letters, digits and `-`",
                self.id
            ));
        }
        check_endpoint(
            &self.endpoint,
            self.tls.is_some(),
            self.allow_plain_http,
            "allow_plain_http: true",
        )
        .map_err(|e| format!("{}: {e}", self.id))?;
        if self.purposes.is_empty() {
            return Err(format!("{}: purposes: offer at least one", self.id));
        }
        if let Some((p, _)) = self
            .purposes
            .iter()
            .find(|(_, image)| image.trim().is_empty())
        {
            return Err(format!("{}: purposes.{p}: the image is empty", self.id));
        }
        if self.capacity == 0 {
            return Err(format!("{}: capacity: must be positive", self.id));
        }
        match (&self.token_file, &self.token_env) {
            (Some(_), Some(_)) => Err(format!(
                "{}: give token_file or token_env, not both",
                self.id
            )),
            (None, None) => Err(format!("{}: give token_file or token_env", self.id)),
            _ => Ok(()),
        }
    }

    fn token(&self) -> Result<String, WorkersError> {
        read_token(
            &format!("worker {}", self.id),
            self.token_file.as_deref(),
            self.token_env.as_deref(),
        )
    }
}

/// The bearer token of `who`: the first line of `file`, trimmed (the one rule,
/// [`cynode_protocol::bearer`]), else the trimmed environment variable `env`. A missing,
/// unreadable or empty token is an error naming `who`.
pub fn read_token(
    who: &str,
    file: Option<&Path>,
    env: Option<&str>,
) -> Result<String, WorkersError> {
    let invalid = |what: String| WorkersError::Token(format!("{who}: {what}"));
    let t = match (file, env) {
        (Some(f), _) => std::fs::read_to_string(f)
            .map(|text| cynode_protocol::bearer::token_in_file(&text).to_string())
            .map_err(|e| invalid(format!("cannot read {}: {e}", f.display())))?,
        (None, Some(v)) => {
            std::env::var(v).map_err(|e| invalid(format!("${v} is not set: {e}")))?
        }
        (None, None) => return Err(invalid("no token".into())),
    };
    let t = t.trim().to_string();
    if t.is_empty() {
        return Err(invalid("the token is empty".into()));
    }
    Ok(t)
}

/// Whether `host` is loopback: 127.0.0.0/8, ::1 or `localhost`.
fn is_loopback(host: &url::Host<&str>) -> bool {
    match host {
        url::Host::Ipv4(ip) => ip.is_loopback(),
        url::Host::Ipv6(ip) => ip.is_loopback(),
        url::Host::Domain(d) => d.trim_end_matches('.').eq_ignore_ascii_case("localhost"),
    }
}

/// A worker endpoint that is not `https://host[:port]` (or allowed plain http).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EndpointError(String);

/// Checks a worker endpoint: `https://host[:port]`, or `http://` to a loopback host
/// unless `allow_plain` (named `allow_how` in the error); `has_tls` settings need
/// `https://`.
pub fn check_endpoint(
    endpoint: &str,
    has_tls: bool,
    allow_plain: bool,
    allow_how: &str,
) -> Result<(), EndpointError> {
    let url = url::Url::parse(endpoint).map_err(|e| {
        EndpointError(format!(
            "endpoint `{endpoint}`: expected https://host:port ({e})"
        ))
    })?;
    let Some(host) = url.host() else {
        return Err(EndpointError(format!("endpoint `{endpoint}` has no host")));
    };
    match url.scheme() {
        "https" => Ok(()),
        "http" if has_tls => Err(EndpointError(format!(
            "endpoint `{endpoint}`: tls settings are given but the endpoint is plain http; use https://"
        ))),
        "http" if allow_plain || is_loopback(&host) => Ok(()),
        "http" => Err(EndpointError(format!(
            "endpoint `{endpoint}`: plain http to the non-loopback host `{host}` would send the worker token in clear; use https:// (with tls settings), or set {allow_how} on a private network"
        ))),
        other => Err(EndpointError(format!(
            "endpoint `{endpoint}`: scheme `{other}`: expected https:// or http://"
        ))),
    }
}

/// What is wrong with a workers file, or with what one of its workers needs.
#[derive(Debug, thiserror::Error)]
pub enum WorkersError {
    /// The file is not a workers file, or an entry breaks a rule (the message names it).
    #[error("{0}")]
    Invalid(String),
    /// A worker's token cannot be read.
    #[error("{0}")]
    Token(String),
    #[error("worker {id}: tls: {cause}")]
    Tls {
        id: String,
        cause: cynode_tls::TlsError,
    },
}

impl WorkersFile {
    /// Parses and checks a workers file (unknown fields, duplicate ids, bad endpoints and
    /// empty offers are errors that name the entry).
    pub fn parse(text: &str) -> Result<WorkersFile, WorkersError> {
        let invalid = WorkersError::Invalid;
        let f: WorkersFile = serde_yaml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        if f.workers.is_empty() {
            return Err(invalid("workers: list at least one worker".into()));
        }
        let mut seen = std::collections::BTreeSet::new();
        for w in &f.workers {
            w.check().map_err(|e| invalid(format!("workers: {e}")))?;
            if !seen.insert(&w.id) {
                return Err(invalid(format!("workers: id `{}` is used twice", w.id)));
            }
        }
        Ok(f)
    }

    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<WorkersFile, FileError<WorkersError>> {
        crate::settings_file::load("workers file", path, Self::parse)
    }
}

/// Where a job goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub worker_id: String,
    pub image: String,
}

/// Why no worker can take a job now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    /// No registered worker offers the purpose: the job can never run here.
    #[error("no worker offers sandbox purpose `{purpose}` (offered: {})", offered.join(", "))]
    NoPurpose {
        purpose: String,
        offered: Vec<String>,
    },
    /// Workers offer it, but none answered ready: may succeed later.
    #[error("no worker offering `{purpose}` is reachable ({})", tried.join("; "))]
    Unreachable { purpose: String, tried: Vec<String> },
    /// The session's workspace is on a worker that does not offer the purpose.
    #[error("this session's workspace is on worker `{worker}`, which does not offer sandbox purpose `{purpose}` (it offers: {})", offered.join(", "))]
    PinnedLacksPurpose {
        worker: String,
        purpose: String,
        offered: Vec<String>,
    },
    /// The session's worker is no longer in the registry.
    #[error("this session's workspace is on worker `{0}`, which is no longer configured")]
    Unknown(String),
    /// Every worker offering the purpose refused this PM's token (401/403) or failed the
    /// TLS handshake (an untrusted worker certificate, a refused or missing client
    /// certificate): final, neither fixes itself.
    #[error("authentication failed: {}", refused.join("; "))]
    Auth { refused: Vec<String> },
}

impl PlaceError {
    /// Whether the same placement may succeed later.
    pub fn is_retryable(&self) -> bool {
        matches!(self, PlaceError::Unreachable { .. })
    }
}

/// Why a capacity probe failed.
enum Probe {
    /// The worker refused the token (401/403), or the TLS handshake failed: retrying
    /// cannot help.
    Auth(String),
    /// Unreachable, not ready or erroring: may answer later.
    Down(String),
}

/// Health of one worker as this process last saw it.
#[derive(Debug, Default)]
struct Health {
    down_until: Option<Instant>,
    failures: u32,
}

struct Member {
    entry: WorkerEntry,
    client: WorkerClient,
    health: Mutex<Health>,
    /// Jobs this process placed on it (tie-breaker: spreads bursts placed before the
    /// workers' own counts move).
    placed: AtomicU64,
}

/// The registry with each worker's client and health.
pub struct WorkerPool {
    members: Vec<Member>,
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.members.iter().map(|m| &m.entry.id))
            .finish()
    }
}

impl WorkerPool {
    /// A pool of the workers of `file`, reading their tokens now.
    pub fn from_file(file: &WorkersFile) -> Result<WorkerPool, WorkersError> {
        let members =
            file.workers
                .iter()
                .map(|e| {
                    let tls = e.tls.clone().unwrap_or_default();
                    let client = WorkerClient::with_tls(&e.endpoint, &e.token()?, &tls).map_err(
                        |cause| WorkersError::Tls {
                            id: e.id.clone(),
                            cause,
                        },
                    )?;
                    Ok(Member::new(e.clone(), client))
                })
                .collect::<Result<_, WorkersError>>()?;
        Ok(WorkerPool { members })
    }

    /// One worker offering every purpose with `image` (`--worker-endpoint`, the local
    /// worker of `run`).
    pub fn single(client: WorkerClient, image: &str) -> WorkerPool {
        let entry = WorkerEntry {
            id: "default".into(),
            endpoint: client.base().to_string(),
            token_file: None,
            token_env: None,
            tls: None,
            allow_plain_http: false,
            purposes: BTreeMap::from([(ANY_PURPOSE.to_string(), image.to_string())]),
            capacity: default_capacity(),
            labels: BTreeMap::new(),
        };
        WorkerPool {
            members: vec![Member::new(entry, client)],
        }
    }

    /// The client of worker `id`. Sessions saved before the registry existed name no
    /// worker (`""`): with a single worker that one is meant.
    pub fn client(&self, id: &str) -> Option<&WorkerClient> {
        self.member(id).map(|m| &m.client)
    }

    fn member(&self, id: &str) -> Option<&Member> {
        match self.members.iter().find(|m| m.entry.id == id) {
            Some(m) => Some(m),
            None if id.is_empty() && self.members.len() == 1 => self.members.first(),
            None => None,
        }
    }

    /// Every purpose some worker offers, sorted.
    pub fn offered(&self) -> Vec<String> {
        let mut all: Vec<String> = self
            .members
            .iter()
            .flat_map(|m| m.entry.purposes.keys().cloned())
            .collect();
        all.sort();
        all.dedup();
        all
    }

    /// Whether some worker offers `purpose`.
    pub fn offers(&self, purpose: &str) -> bool {
        self.members
            .iter()
            .any(|m| m.entry.image_for(purpose).is_some())
    }

    /// A job of `purpose` for a session whose workspace is on `worker_id`.
    pub fn pinned(&self, worker_id: &str, purpose: &str) -> Result<Placement, PlaceError> {
        let m = self
            .member(worker_id)
            .ok_or_else(|| PlaceError::Unknown(worker_id.to_string()))?;
        match m.entry.image_for(purpose) {
            Some(image) => Ok(Placement {
                worker_id: m.entry.id.clone(),
                image: image.to_string(),
            }),
            None => Err(PlaceError::PinnedLacksPurpose {
                worker: m.entry.id.clone(),
                purpose: purpose.to_string(),
                offered: m.entry.purposes.keys().cloned().collect(),
            }),
        }
    }

    /// Chooses the worker for a session's first job of `purpose` (see the module doc).
    pub async fn place(&self, purpose: &str) -> Result<Placement, PlaceError> {
        let candidates: Vec<&Member> = self
            .members
            .iter()
            .filter(|m| m.entry.image_for(purpose).is_some())
            .collect();
        if candidates.is_empty() {
            return Err(PlaceError::NoPurpose {
                purpose: purpose.to_string(),
                offered: self.offered(),
            });
        }
        let now = Instant::now();
        let (mut up, mut down): (Vec<&Member>, Vec<&Member>) =
            candidates.into_iter().partition(|m| !m.is_down(now));
        if up.is_empty() {
            // Every candidate is backing off: ask the one whose backoff ends first rather
            // than refuse outright (the caller retries with its own backoff). Its answer,
            // not its old mark, is what counts: a refusal then fails at once.
            if let Some(first) = (0..down.len()).min_by_key(|&i| down[i].down_until()) {
                up.push(down.remove(first));
            }
        }
        let mut tried: Vec<String> = down
            .iter()
            .map(|m| format!("{}: marked down, retried after its backoff", m.entry.id))
            .collect();
        let probes = futures_util::future::join_all(up.iter().map(|m| m.probe())).await;
        let mut answered = Vec::new();
        let mut refused = Vec::new();
        for (m, r) in up.into_iter().zip(probes) {
            match r {
                Ok(c) => answered.push((m, c)),
                Err(Probe::Auth(why)) => refused.push(format!("worker `{}`: {why}", m.entry.id)),
                Err(Probe::Down(why)) => tried.push(format!("{}: {why}", m.entry.id)),
            }
        }
        if answered.is_empty() && !refused.is_empty() && tried.is_empty() {
            return Err(PlaceError::Auth { refused });
        }
        tried.extend(refused);
        let best = choose(
            answered
                .iter()
                .map(|(m, c)| Candidate {
                    free: free(m.entry.capacity, c),
                    placed: m.placed.load(Ordering::Relaxed),
                })
                .collect::<Vec<_>>()
                .as_slice(),
        );
        let Some(i) = best else {
            return Err(PlaceError::Unreachable {
                purpose: purpose.to_string(),
                tried,
            });
        };
        let (m, c) = &answered[i];
        m.placed.fetch_add(1, Ordering::Relaxed);
        crate::metrics::metrics()
            .placements
            .get_or_create(&crate::metrics::WorkerLabel {
                worker: m.entry.id.clone(),
            })
            .inc();
        tracing::info!(
            worker = %m.entry.id,
            purpose,
            running = c.running,
            queued = c.queued,
            capacity = m.entry.capacity,
            "placed the session's workspace"
        );
        Ok(Placement {
            worker_id: m.entry.id.clone(),
            image: m.entry.image_for(purpose).unwrap_or_default().to_string(),
        })
    }

    /// Whether at least one worker answers its `/readyz` (for the PM's `/readyz`). A
    /// worker that answers is marked up; one that does not keeps its placement backoff
    /// as it is (readiness probes do not lengthen it).
    pub async fn any_ready(&self) -> bool {
        let answers = futures_util::future::join_all(self.members.iter().map(|m| async move {
            let ok = tokio::time::timeout(PROBE_TIMEOUT, m.client.ready())
                .await
                .unwrap_or(false);
            if ok {
                m.mark_up();
            }
            ok
        }))
        .await;
        answers.into_iter().any(|ok| ok)
    }
}

impl Member {
    fn new(entry: WorkerEntry, client: WorkerClient) -> Self {
        Member {
            entry,
            client,
            health: Mutex::new(Health::default()),
            placed: AtomicU64::new(0),
        }
    }

    /// Asks the worker for its load; a worker that answers ready is marked up, any other
    /// outcome marks it down and says why.
    async fn probe(&self) -> Result<WorkerCapacity, Probe> {
        let why = match tokio::time::timeout(PROBE_TIMEOUT, self.client.capacity()).await {
            Ok(Ok(c)) if c.ready => {
                self.mark_up();
                return Ok(c);
            }
            Ok(Ok(_)) => "not ready".to_string(),
            Ok(Err(e @ (DispatchError::Auth { .. } | DispatchError::Tls { .. }))) => {
                self.mark_down(&e.to_string());
                return Err(Probe::Auth(e.to_string()));
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {PROBE_TIMEOUT:?}"),
        };
        self.mark_down(&why);
        Err(Probe::Down(why))
    }

    fn is_down(&self, now: Instant) -> bool {
        self.down_until().is_some_and(|t| t > now)
    }

    fn down_until(&self) -> Option<Instant> {
        self.health.lock().ok().and_then(|h| h.down_until)
    }

    fn mark_down(&self, why: &str) {
        if let Ok(mut h) = self.health.lock() {
            h.failures = h.failures.saturating_add(1);
            let backoff = DOWN_FIRST
                .saturating_mul(1 << (h.failures - 1).min(5))
                .min(DOWN_MAX);
            h.down_until = Some(Instant::now() + backoff);
            crate::metrics::metrics().worker_up(&self.entry.id, false);
            tracing::warn!(worker = %self.entry.id, why, failures = h.failures, backoff_ms = backoff.as_millis() as u64, "worker skipped: unreachable or not ready");
        }
    }

    fn mark_up(&self) {
        crate::metrics::metrics().worker_up(&self.entry.id, true);
        if let Ok(mut h) = self.health.lock() {
            if h.failures > 0 {
                tracing::info!(worker = %self.entry.id, "worker is back");
            }
            *h = Health::default();
        }
    }
}

/// Free room on a worker: this registry's capacity and the node's own limits, less what
/// it holds now. Negative when over capacity.
fn free(capacity: u64, c: &WorkerCapacity) -> i64 {
    let limit = capacity.min(c.max_running + c.max_queued);
    limit as i64 - (c.running + c.queued) as i64
}

/// What placement compares.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    free: i64,
    placed: u64,
}

/// The index of the best candidate: most free room, then fewest placed by this process,
/// then the earliest (file order).
fn choose(c: &[Candidate]) -> Option<usize> {
    (0..c.len()).min_by_key(|&i| (std::cmp::Reverse(c[i].free), c[i].placed, i))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
workers:
  - id: w1
    endpoint: https://10.0.0.1:9190
    token_file: /run/secrets/w1
    capacity: 8
    purposes:
      base-tools: localhost/cynode-sba:latest
      python-tools: localhost/cynode-sba-python:latest
    labels: { zone: a }
  - id: w2
    endpoint: http://10.0.0.2:9190
    allow_plain_http: true
    token_env: CYNODE_W2_TOKEN
    purposes:
      "*": localhost/cynode-sba:latest
"#;

    #[test]
    fn a_good_file_parses_with_defaults() {
        let f = WorkersFile::parse(GOOD).unwrap();
        assert_eq!(f.workers.len(), 2);
        assert_eq!(f.workers[0].capacity, 8);
        assert_eq!(f.workers[1].capacity, default_capacity());
        assert_eq!(
            f.workers[0].image_for("python-tools"),
            Some("localhost/cynode-sba-python:latest")
        );
        assert_eq!(f.workers[0].image_for("go-tools"), None);
        assert_eq!(
            f.workers[1].image_for("go-tools"),
            Some("localhost/cynode-sba:latest")
        );
    }

    #[test]
    fn bad_files_name_the_problem() {
        let cases = [
            (
                GOOD.replace("capacity: 8", "capacity: 0"),
                "w1: capacity: must be positive",
            ),
            (GOOD.replace("id: w2", "id: w1"), "id `w1` is used twice"),
            (
                GOOD.replace("    allow_plain_http: true\n", ""),
                "w2: endpoint `http://10.0.0.2:9190`: plain http to the non-loopback host `10.0.0.2` would send the worker token in clear; use https:// (with tls settings), or set allow_plain_http: true",
            ),
            (
                GOOD.replace("https://10.0.0.1:9190", "http://10.0.0.1:9190"),
                "w1: endpoint `http://10.0.0.1:9190`: plain http to the non-loopback host",
            ),
            (
                GOOD.replace(
                    "    allow_plain_http: true\n",
                    "    allow_plain_http: true\n    tls: { ca_file: /etc/ca.pem }\n",
                ),
                "w2: endpoint `http://10.0.0.2:9190`: tls settings are given but the endpoint is plain http",
            ),
            (
                GOOD.replace(
                    "    token_file: /run/secrets/w1\n",
                    "    token_file: /run/secrets/w1\n    tls: { ca: /etc/ca.pem }\n",
                ),
                "unknown field `ca`",
            ),
            (
                GOOD.replace("https://10.0.0.1:9190", "ftp://10.0.0.1"),
                "w1: endpoint `ftp://10.0.0.1`: scheme `ftp`",
            ),
            (
                GOOD.replace("https://10.0.0.1:9190", "https://"),
                "w1: endpoint `https://`",
            ),
            (GOOD.replace("labels:", "label:"), "unknown field `label`"),
            (
                GOOD.replace("token_env: CYNODE_W2_TOKEN", ""),
                "w2: give token_file or token_env",
            ),
            (GOOD.replace("id: w1", "id: W1"), "id `W1`"),
            ("workers: []".to_string(), "list at least one worker"),
            (
                GOOD.replace("\"*\": localhost/cynode-sba:latest", "\"*\": \"\""),
                "w2: purposes.*: the image is empty",
            ),
        ];
        for (text, want) in cases {
            let err = format!("{:#}", WorkersFile::parse(&text).unwrap_err());
            assert!(err.contains(want), "want `{want}` in: {err}");
        }
    }

    #[test]
    fn tls_settings_parse_and_loopback_may_stay_plain() {
        let text = GOOD.replace(
            "    token_file: /run/secrets/w1\n",
            "    token_file: /run/secrets/w1\n    tls:\n      ca_file: /etc/cynode/ca.pem\n      cert_file: /etc/cynode/pm.pem\n      key_file: /etc/cynode/pm-key.pem\n",
        );
        let f = WorkersFile::parse(&text).unwrap();
        assert_eq!(
            f.workers[0].tls,
            Some(ClientTls {
                ca_file: Some("/etc/cynode/ca.pem".into()),
                cert_file: Some("/etc/cynode/pm.pem".into()),
                key_file: Some("/etc/cynode/pm-key.pem".into()),
            })
        );
        assert!(f.workers[1].allow_plain_http && !f.workers[0].allow_plain_http);
        for host in [
            "127.0.0.1:9190",
            "127.8.9.10",
            "[::1]:9190",
            "localhost:9190",
            "LOCALHOST.",
        ] {
            let text = GOOD
                .replace("    allow_plain_http: true\n", "")
                .replace("10.0.0.2:9190", host);
            assert!(WorkersFile::parse(&text).is_ok(), "http://{host} refused");
        }
        for host in ["128.0.0.1", "[::2]:1", "localhost.example", "0.0.0.0:9190"] {
            let text = GOOD
                .replace("    allow_plain_http: true\n", "")
                .replace("10.0.0.2:9190", host);
            let err = format!("{:#}", WorkersFile::parse(&text).unwrap_err());
            assert!(
                err.contains("plain http to the non-loopback host"),
                "{host}: {err}"
            );
        }
    }

    #[test]
    fn unreadable_tls_files_are_a_start_up_error_naming_the_worker() {
        let token = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(token.path(), "t0123456789\n").unwrap();
        let text = GOOD
            .replace(
                "    token_file: /run/secrets/w1\n",
                &format!(
                    "    token_file: {}\n    tls: {{ ca_file: /nonexistent/ca.pem }}\n",
                    token.path().display()
                ),
            )
            .replace(
                "token_env: CYNODE_W2_TOKEN",
                &format!("token_file: {}", token.path().display()),
            );
        let err = format!(
            "{:#}",
            WorkerPool::from_file(&WorkersFile::parse(&text).unwrap()).unwrap_err()
        );
        assert!(
            err.contains("worker w1: tls") && err.contains("/nonexistent/ca.pem"),
            "{err}"
        );
    }

    fn cap(running: u64, queued: u64) -> WorkerCapacity {
        WorkerCapacity {
            version: 1,
            backend: "bwrap".into(),
            max_running: 2,
            max_queued: 64,
            running,
            queued,
            ready: true,
        }
    }

    #[test]
    fn free_room_uses_the_smaller_limit() {
        assert_eq!(free(4, &cap(1, 0)), 3);
        assert_eq!(free(100, &cap(2, 3)), 61);
        assert_eq!(free(2, &cap(2, 3)), -3);
    }

    #[test]
    fn most_room_wins_then_fewest_placed_then_file_order() {
        let c = |free, placed| Candidate { free, placed };
        assert_eq!(choose(&[]), None);
        assert_eq!(choose(&[c(1, 0), c(3, 9)]), Some(1));
        assert_eq!(choose(&[c(2, 5), c(2, 1), c(2, 1)]), Some(1));
        assert_eq!(choose(&[c(-3, 0), c(-1, 7)]), Some(1));
        assert_eq!(choose(&[c(0, 0), c(0, 0)]), Some(0));
    }

    #[tokio::test]
    async fn pinned_sessions_stay_and_unknown_purposes_are_named() {
        let token = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(token.path(), "t0123456789\n").unwrap();
        let file = format!("token_file: {}", token.path().display());
        // Port 1 on loopback refuses at once: both workers are unreachable.
        let text = GOOD
            .replace("token_file: /run/secrets/w1", &file)
            .replace("token_env: CYNODE_W2_TOKEN", &file)
            .replace("10.0.0.1:9190", "127.0.0.1:1")
            .replace("10.0.0.2:9190", "127.0.0.1:1")
            .replace("\"*\"", "go-tools");
        let pool = WorkerPool::from_file(&WorkersFile::parse(&text).unwrap()).unwrap();
        assert_eq!(
            pool.pinned("w1", "python-tools").unwrap(),
            Placement {
                worker_id: "w1".into(),
                image: "localhost/cynode-sba-python:latest".into()
            }
        );
        let e = pool.pinned("w2", "python-tools").unwrap_err();
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("it offers: go-tools"), "{e}");
        assert_eq!(
            pool.pinned("gone", "go-tools").unwrap_err(),
            PlaceError::Unknown("gone".into())
        );
        let e = pool.place("rust-tools").await.unwrap_err();
        assert_eq!(
            e,
            PlaceError::NoPurpose {
                purpose: "rust-tools".into(),
                offered: vec![
                    "base-tools".into(),
                    "go-tools".into(),
                    "python-tools".into()
                ]
            }
        );
        let e = pool.place("base-tools").await.unwrap_err();
        assert!(e.is_retryable(), "{e}");
        assert!(pool.members[0].is_down(Instant::now()));
        assert!(
            !pool.members[1].is_down(Instant::now()),
            "w2 was not a candidate"
        );
    }
}
