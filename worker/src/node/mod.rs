//! The node: accepts jobs (sync and async), bounds how many run and wait, records every
//! job durably before acting, serves results until they are acked, and reconciles after a
//! restart so nothing is silently lost.
//!
//! - `jobs`: `jobs:run`, submit, status, stop and ack, and running one job to its end.
//! - `reconcile`: settling what a previous run left, after a restart.
//! - `retained`: finished jobs kept for their caller: artifacts and retention expiry.
//!
//! The HTTP routes are in [`crate::http`]; this module knows no HTTP.

mod jobs;
mod reconcile;
mod retained;
mod servers;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cynode_protocol::worker_api::{WorkerCapacity, API_VERSION};
use cynode_protocol::ValidationError;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::backend::SandboxBackend;
use crate::config::Config;
use crate::inference::{Upstream, UpstreamError};
use crate::sessions::Sessions;
use crate::store::{JobRecord, Store, StoreError};

/// Why the node refused or could not serve a call.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The request or job.json is invalid, or the node cannot serve it (its image, models).
    #[error("{0}")]
    Invalid(#[from] ValidationError),
    /// `queue.max_running + queue.max_queued` jobs are held already.
    #[error("the node is at capacity")]
    Busy,
    /// No such job (or artifact) on this node.
    #[error("{0}")]
    NotFound(String),
    /// The job_id names another request, or the job is not finished yet.
    #[error("{0}")]
    Conflict(String),
    /// No host uid for the job's workspace (503 when `sandbox_uids` is exhausted).
    #[error(transparent)]
    Uid(#[from] crate::uid_pool::UidError),
    /// The store or the host failed.
    #[error("{0}")]
    Internal(String),
}

impl From<StoreError> for NodeError {
    fn from(e: StoreError) -> Self {
        NodeError::Internal(e.to_string())
    }
}

/// Why the node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot create {}", .0.display())]
    CreateDir(PathBuf, #[source] std::io::Error),
    #[error("cannot set permissions on {}", .0.display())]
    Permissions(PathBuf, #[source] std::io::Error),
    #[error("cannot open the job database")]
    Database(#[source] StoreError),
    #[error(transparent)]
    Inference(#[from] UpstreamError),
    #[error(transparent)]
    Egress(#[from] crate::job_egress::EgressStartError),
    /// `gateway.tls` names a file that cannot be read or used.
    #[error("{0}")]
    Gateway(String),
    /// Settling the jobs a previous run left failed.
    #[error(transparent)]
    Reconcile(#[from] StoreError),
    /// `sandbox_uids` overlaps users, groups or subordinate ranges of the host.
    #[error("sandbox_uids {first}..{end} overlaps the host's ids: {conflicts}")]
    SandboxUids {
        first: u32,
        end: u64,
        conflicts: String,
    },
}

pub use cynode_protocol::worker_health::Readiness;

/// The node's shared state.
pub struct Node {
    pub cfg: Arc<Config>,
    pub backend: Arc<dyn SandboxBackend>,
    pub store: Store,
    pub token: String,
    pub sessions: Sessions,
    /// The host uid of each workspace.
    pub uids: Arc<crate::uid_pool::UidPool>,
    /// The inference upstream, when configured.
    pub inference: Option<Arc<Upstream>>,
    /// The egress proxies' shared parts, when the node allows any destination.
    pub egress: Option<Arc<crate::job_egress::NodeEgress>>,
    /// The client to the PM's tool gateway (config `gateway.tls`), shared by the jobs'
    /// gateway sockets.
    pub gateway: reqwest::Client,
    running: Mutex<HashMap<String, CancellationToken>>,
    permits: Arc<Semaphore>,
    waiting: AtomicUsize,
    readiness: Mutex<Readiness>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("backend", &self.backend.kind())
            .finish()
    }
}

impl Node {
    /// Opens the state directory, reconciles what a previous run left, checks readiness.
    pub async fn start(mut cfg: Config, token: String) -> Result<Arc<Node>, StartError> {
        std::fs::create_dir_all(&cfg.state_dir)
            .map_err(|e| StartError::CreateDir(cfg.state_dir.clone(), e))?;
        // The kernel names mounts and loop devices' files by their real paths: the node's
        // own must be the same strings (a symlinked or relative state_dir would otherwise
        // never match them).
        cfg.state_dir = std::fs::canonicalize(&cfg.state_dir)
            .map_err(|e| StartError::CreateDir(cfg.state_dir.clone(), e))?;
        for d in [cfg.state_dir.clone(), cfg.jobs_dir(), cfg.workspaces_dir()] {
            std::fs::create_dir_all(&d).map_err(|e| StartError::CreateDir(d.clone(), e))?;
            // Sandboxes run as their workspace's uid and must traverse to their directories.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| StartError::Permissions(d.clone(), e))?;
        }
        // Before reconciliation reads what a previous run left: its volumes are back.
        let (layout, shape, pool) = crate::loopfs::plan(&cfg);
        let _ = tokio::task::spawn_blocking(move || crate::loopfs::init(layout, shape, pool)).await;
        // Seeds a previous run did not finish: their staging trees go, with their volumes.
        let staging = cfg.state_dir.join("staging");
        if let Err(e) = crate::remove_tree::remove_tree_async(staging).await {
            tracing::warn!(error = %e, "cannot remove the staging trees a previous run left");
        }
        let store = Store::open(&cfg.database_path())
            .await
            .map_err(StartError::Database)?;
        let range = cfg.sandbox_uids;
        let conflicts = range.host_conflicts();
        if !conflicts.is_empty() {
            return Err(StartError::SandboxUids {
                first: range.first,
                end: range.end(),
                conflicts: conflicts.join("; "),
            });
        }
        let uids = Arc::new(crate::uid_pool::UidPool::for_node(&cfg, store.clone()));
        let backend = crate::backend::from_config(&cfg);
        let inference = match &cfg.inference {
            Some(i) => Some(Arc::new(Upstream::from_config(i)?)),
            None => None,
        };
        let egress = crate::job_egress::NodeEgress::from_config(&cfg.egress)?;
        let gateway =
            crate::gateway_forward::client(&cfg.gateway.tls).map_err(StartError::Gateway)?;
        let node = Arc::new(Node {
            inference: inference.clone(),
            egress: egress.clone(),
            gateway,
            sessions: Sessions::new(
                &cfg,
                backend.clone(),
                Arc::clone(&uids),
                egress,
                inference.clone(),
            ),
            uids,
            permits: Arc::new(Semaphore::new(cfg.queue.max_running.max(1))),
            cfg: Arc::new(cfg),
            backend,
            store,
            token,
            running: Mutex::new(HashMap::new()),
            waiting: AtomicUsize::new(0),
            readiness: Mutex::new(Readiness {
                ready: false,
                detail: "starting".into(),
            }),
        });
        node.reconcile().await?;
        // Suspended sessions and snapshots are in the store: loaded again before any request.
        node.sessions.attach_store(node.store.clone());
        if let Err(e) = node.sessions.restore().await {
            tracing::warn!(error = %e, "cannot load the suspended sessions again");
        }
        node.sessions.start_reaper();
        node.check_ready().await;
        let weak = Arc::downgrade(&node);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(60));
            loop {
                tick.tick().await;
                let Some(node) = weak.upgrade() else { return };
                node.expire_retained().await;
            }
        });
        Ok(node)
    }

    /// Re-runs the startup checks and records the outcome.
    pub async fn check_ready(&self) -> Readiness {
        let r = match (self.backend.check().await, self.store.ping().await) {
            (Ok(v), Ok(())) => Readiness {
                ready: true,
                detail: format!("backend {}: {v}", self.backend.kind().as_str()),
            },
            (Err(e), _) => Readiness {
                ready: false,
                detail: format!("backend {}: {e}", self.backend.kind().as_str()),
            },
            (_, Err(e)) => Readiness {
                ready: false,
                detail: format!("database: {e}"),
            },
        };
        if let Ok(mut g) = self.readiness.lock() {
            *g = r.clone();
        }
        r
    }

    /// The last readiness outcome.
    pub fn readiness(&self) -> Readiness {
        self.readiness
            .lock()
            .map(|g| g.clone())
            .unwrap_or(Readiness {
                ready: false,
                detail: "readiness lock poisoned".into(),
            })
    }

    /// What this node can take: configured limits and the jobs it holds now.
    pub fn capacity(&self) -> WorkerCapacity {
        let max_running = self.cfg.queue.max_running.max(1);
        let active = self.waiting.load(Ordering::SeqCst);
        let running = max_running - self.permits.available_permits().min(max_running);
        WorkerCapacity {
            version: API_VERSION,
            backend: self.backend.kind().as_str().to_string(),
            max_running: max_running as u64,
            max_queued: self.cfg.queue.max_queued as u64,
            running: running as u64,
            queued: active.saturating_sub(running) as u64,
            ready: self.readiness().ready,
        }
    }

    fn take_slot(&self) -> Result<(), NodeError> {
        let limit = self.cfg.queue.max_queued + self.cfg.queue.max_running.max(1);
        let prev = self.waiting.fetch_add(1, Ordering::SeqCst);
        if prev >= limit {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(NodeError::Busy);
        }
        Ok(())
    }

    /// Cancels every running job (graceful shutdown after the grace period).
    pub fn cancel_all(&self) {
        if let Ok(g) = self.running.lock() {
            for t in g.values() {
                t.cancel();
            }
        }
    }

    /// The record of `job_id`, or not found.
    async fn record(&self, job_id: &str) -> Result<JobRecord, NodeError> {
        self.store
            .get(job_id)
            .await?
            .ok_or_else(|| NodeError::NotFound(format!("job {job_id} not found")))
    }

    /// The record of `job_id` once the job has finished; a conflict before.
    async fn finished_record(&self, job_id: &str) -> Result<JobRecord, NodeError> {
        let rec = self.record(job_id).await?;
        if !rec.state.is_terminal() {
            return Err(NodeError::Conflict(format!("job {job_id} is not finished")));
        }
        Ok(rec)
    }

    /// The bounds of a job's sockets (status and inference): the API listener's timeouts
    /// and header cap, `limits.job_socket_connections` connections.
    pub(crate) fn job_sockets(&self) -> cynode_tls::ListenerLimits {
        self.cfg
            .listener
            .with_max_connections(self.cfg.limits.job_socket_connections)
    }

    /// Jobs currently waiting or running.
    pub fn active(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }
}
