//! The PM's settings as plain values: what [`crate::bootstrap`] builds a PM from.
//!
//! Architecture invariant: no command-line parser is known here. The binary's `cli/`
//! turns flags and environment into these values; a test or an embedding program writes
//! them directly.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cynode_tls::ClientTls;

use crate::llm::ModelConfig;

/// Everything a PM is built from, whichever command runs it.
#[derive(Debug, Clone)]
pub struct PmConfig {
    /// The OpenAI-compatible model endpoint and its request settings.
    pub model: ModelConfig,
    /// Where the PM keeps its SQLite database (unless `datastore`) and its artifacts.
    pub state_dir: PathBuf,
    /// `sqlite://PATH` or `postgres://…`; `None`: `<state_dir>/pm.db`.
    pub datastore: Option<String>,
    pub skills: SkillSources,
    pub policy: PolicySource,
    /// Tenant policy settings (YAML or JSON); `None`: no network, default ceilings.
    pub tenant_file: Option<PathBuf>,
    /// How long a session's first job waits for a worker offering its purpose.
    pub worker_wait: Duration,
}

impl PmConfig {
    /// The datastore's URL: `datastore`, else SQLite in the state directory (by its
    /// canonical path once the directory exists).
    pub fn datastore_url(&self) -> String {
        datastore_url(self.datastore.as_deref(), &self.state_dir)
    }

    /// Where verified artifacts are stored.
    pub fn artifacts_dir(&self) -> PathBuf {
        self.state_dir.join("artifacts")
    }
}

/// The datastore's URL: `datastore`, else SQLite `pm.db` in `state_dir` (by its canonical
/// path once the directory exists).
pub fn datastore_url(datastore: Option<&str>, state_dir: &Path) -> String {
    match datastore {
        Some(u) => u.to_string(),
        None => {
            let dir = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
            format!("sqlite://{}", dir.join("pm.db").display())
        }
    }
}

/// Which skill packages are offered.
#[derive(Debug, Clone, Default)]
pub struct SkillSources {
    /// Directories of skill packages, added to (or replacing) the built-in ones.
    pub dirs: Vec<PathBuf>,
    /// Only the skills of `dirs`, none of the built-in ones.
    pub no_builtin: bool,
}

/// Which policy decides.
#[derive(Debug, Clone, Default)]
pub enum PolicySource {
    /// The built-in policy (`policies/cynode.rego`).
    #[default]
    Builtin,
    /// The Rego policy of this directory.
    Dir(PathBuf),
    /// An external OPA-compatible engine (fails closed).
    Remote(String),
}

/// The workers a PM places jobs on; `None` where it is optional means a local worker
/// (`cynode-pm run` only).
#[derive(Debug, Clone)]
pub enum WorkersConfig {
    /// A workers file: several workers with their tokens, purposes, images and capacity.
    File(PathBuf),
    /// One worker offering every purpose with one image.
    Endpoint(RemoteWorker),
}

/// One worker given by its endpoint.
#[derive(Debug, Clone)]
pub struct RemoteWorker {
    pub endpoint: String,
    pub tls: ClientTls,
    /// Allows plain http:// to a non-loopback host.
    pub allow_plain_http: bool,
    /// The bearer token's file; `None`: the `CYNODE_WORKER_TOKEN` environment variable.
    pub token_file: Option<PathBuf>,
    /// The sandbox image of every job.
    pub image: String,
}

/// The worker `cynode-pm run` starts (and stops) itself when no worker is configured.
#[derive(Debug, Clone)]
pub struct LocalWorkerConfig {
    /// The worker binary (`cynode-worker` next to `cynode-pm`).
    pub program: PathBuf,
    /// Its state lives in `<state_dir>/worker`.
    pub state_dir: PathBuf,
    /// `podman`, `docker` or `bwrap`.
    pub backend: String,
    /// The bwrap root filesystem of `image`.
    pub bwrap_rootfs: Option<PathBuf>,
    /// The sandbox image of every job.
    pub image: String,
    /// A directory its workspaces may be seeded from.
    pub seed: Option<PathBuf>,
    /// Its `egress.allow` ceiling (sorted, no duplicates): the tenant's `egress.allow`
    /// and `run --egress-allow`. Empty: its egress proxy lets nothing through.
    pub egress_allow: Vec<String>,
    /// Where it exports traces.
    pub otlp_endpoint: Option<String>,
    /// Its inference upstream, for agent jobs: this run's model when that model needs no
    /// key, else the run's [`crate::inference_relay`] (the key stays in the PM; the
    /// worker gets a key per job). `None`: agent jobs on it are refused for
    /// want of inference.
    pub inference: Option<LocalInference>,
    /// The program that keeps the worker (`cynode-pm` itself, run as
    /// `local_worker::keeper::KEEPER_ARG`).
    pub keeper: PathBuf,
    /// How long the worker outlives a PM that vanished (kill -9, Ctrl-C) with nobody
    /// attached: its running job finishes and its result is kept for a resume.
    pub grace: std::time::Duration,
}

/// The local worker's inference upstream (its worker.yaml `inference`): an
/// OpenAI-compatible base URL and the extra CA its TLS trusts. No model key, ever, and no
/// standing credential: when `base_url` is the run's inference relay, each job carries a
/// key of its own, minted at dispatch and revoked when it ends (`key_per_job`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalInference {
    pub base_url: String,
    pub ca_file: Option<PathBuf>,
    /// `base_url` is the run's inference relay: the worker takes each job's key from
    /// the job's request (worker.yaml `inference.key_per_job`).
    pub key_per_job: bool,
}
