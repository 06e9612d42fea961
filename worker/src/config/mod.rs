//! Node configuration: a YAML file, overridden by flags, with safe defaults when neither
//! says anything. The bearer token never lives in the file itself: it comes from
//! `--token-file`, the file's `token_file`, or `WORKER_API_BEARER_TOKEN`.

pub mod microvm;
pub mod sandbox_uids;
pub mod session_state;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use cynode_protocol::worker_api::{
    DEFAULT_MAX_REQUEST_BYTES, DEFAULT_OUTPUT_CAP_BYTES, DEFAULT_TIMEOUT_SECONDS,
    MAX_TIMEOUT_SECONDS,
};
use serde::{Deserialize, Serialize};

/// Which sandbox technology runs jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Podman,
    Docker,
    Bwrap,
    /// A KVM microVM per job (QEMU `microvm`, own kernel): see `backend::microvm`.
    Microvm,
    /// The in-process fake of the worker's unit tests (`backend::fake`); no built node has it.
    #[cfg(test)]
    Fake,
}

impl BackendKind {
    /// The name readyz and logs use.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Podman => "podman",
            BackendKind::Docker => "docker",
            BackendKind::Bwrap => "bwrap",
            BackendKind::Microvm => "microvm",
            #[cfg(test)]
            BackendKind::Fake => "fake",
        }
    }
}

/// The whole node configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub listen: SocketAddr,
    /// File holding the bearer token (first line, trimmed).
    pub token_file: Option<PathBuf>,
    pub backend: BackendKind,
    /// Where job records, job directories and workspaces live.
    pub state_dir: PathBuf,
    /// Keys left out take Podman's defaults (binary `podman`, runtime `runc`).
    #[serde(deserialize_with = "podman_engine")]
    pub podman: EngineConfig,
    /// Keys left out take Docker's defaults (binary `docker`), not Podman's.
    #[serde(deserialize_with = "docker_engine")]
    pub docker: EngineConfig,
    pub bwrap: BwrapConfig,
    pub microvm: microvm::MicrovmConfig,
    /// Images jobs and sessions may use. Whatever it says, an image must be a valid OCI
    /// reference (`name[:tag][@digest]`, see `image_ref`), so no request value can
    /// become an engine flag. Empty (the default): any valid reference the backend already
    /// has (nothing is ever pulled: `--pull=never`; bwrap: only images with a configured
    /// `bwrap.rootfs`). Production nodes should list their images.
    pub images: Vec<String>,
    /// The image a job request with an empty `sandbox.image` runs in (upstream CyNodeAI
    /// falls back to a default image); still subject to `images`. Unset: such a request
    /// is refused.
    pub default_image: Option<String>,
    /// Run agent jobs (`execution_mode: agent_inference`) and sessions with inference on
    /// images without the label `io.cynodeai.sandbox.agent-compatible=true`. Off (the
    /// default): such a request is refused as `image_not_agent_compatible`
    /// (`backend::image_labels`). Basic jobs never need the label.
    pub allow_unlabelled_agent_images: bool,
    pub limits: Limits,
    pub queue: QueueConfig,
    /// Host directories a workspace may be seeded from.
    pub seed_roots: Vec<PathBuf>,
    /// Directory names left out when seeding from a host directory (dependency caches).
    pub seed_exclude_dirs: Vec<String>,
    /// Terminal jobs not acked within this time are deleted.
    pub retention_seconds: u64,
    /// The OpenAI-compatible upstream behind the per-job inference proxy; without it, jobs
    /// that need inference are refused.
    pub inference: Option<InferenceConfig>,
    /// Serve the Worker API over HTTPS (`cert_file`, `key_file`); `client_ca_file` makes
    /// client certificates required (mutual TLS). Plain http is for loopback only: a
    /// non-loopback `listen` without `tls` needs `allow_plain_http: true`.
    pub tls: Option<cynode_tls::ServerTls>,
    /// Serve plain http on a non-loopback address anyway (e.g. behind a TLS-terminating
    /// proxy on the same host).
    pub allow_plain_http: bool,
    /// Bounds on the Worker API listener's connections (`max_connections`,
    /// `header_read_timeout_seconds`, `idle_timeout_seconds`, `max_header_bytes`,
    /// `tls_handshake_timeout_seconds`); the per-job sockets use the same timeouts and
    /// header cap with `limits.job_socket_connections` connections.
    pub listener: cynode_tls::ListenerLimits,
    /// The egress proxy: where jobs with `network_policy: restricted` may go.
    pub egress: EgressConfig,
    /// Host uids sandboxes run as, one per workspace (`{first, count}`; see
    /// [`crate::uid_pool`]): tenants never share the kernel's per-user budgets.
    pub sandbox_uids: sandbox_uids::UidRange,
    /// The PM's tool gateway, which jobs reach through `/job/gateway.sock`: what the
    /// node trusts when the gateway URL a PM hands it is `https://`.
    pub gateway: GatewayConfig,
    /// Suspended sessions' and workspace snapshots' retention and budget.
    pub session_state: session_state::SessionStateConfig,
}

/// The forwarder to the PM's tool gateway ([`crate::gateway_forward`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// Extra CA (a private one for the PM's certificate) and client identity; the
    /// system's roots, and `SSL_CERT_FILE`, are trusted too.
    pub tls: cynode_tls::ClientTls,
}

/// The egress proxy's settings. `allow` is the node's ceiling: a job's
/// `sandbox.egress_allow` may narrow it, never widen it. Empty (the default): no
/// destination is allowed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EgressConfig {
    /// Patterns `host`, `*.suffix` or an IP address, each with an optional `:port` (80
    /// and 443 when none). A private, loopback or metadata address is reached only when
    /// listed here as an IP literal.
    pub allow: crate::egress::Allowlist,
    /// Name servers the proxy asks (UDP, TCP on truncation). Empty: the host's
    /// `/etc/resolv.conf` and `/etc/hosts`.
    pub nameservers: Vec<SocketAddr>,
    /// Bound on a request head; larger is answered 431.
    pub max_header_bytes: usize,
    /// Connections one job may have open at once.
    pub max_connections: usize,
    /// Bytes one job may move through the proxy, both ways together.
    pub max_total_mb: u64,
    /// A connection idle this long (both ways) is closed.
    pub idle_timeout_seconds: u64,
    /// Bound on one name lookup and one TCP connect.
    pub connect_timeout_seconds: u64,
    /// Audit records kept per job; later attempts are only counted (all are logged).
    pub max_audit_records: usize,
    /// Credentialed routes: `<name>: {upstream: "https://…", headers: {"Header": {env:
    /// NODE_VAR}}, ca_file?}`, reached from the sandbox at
    /// `$CYNODE_EGRESS_ROUTES_URL/<name>/…`; the values never enter the sandbox.
    pub routes: BTreeMap<String, crate::egress::RouteConfig>,
}

impl Default for EgressConfig {
    fn default() -> Self {
        let l = crate::egress::EgressLimits::default();
        Self {
            allow: crate::egress::Allowlist::default(),
            nameservers: Vec::new(),
            max_header_bytes: l.max_header_bytes,
            max_connections: l.max_connections,
            max_total_mb: l.max_total_bytes / (1024 * 1024),
            idle_timeout_seconds: l.idle_timeout.as_secs(),
            connect_timeout_seconds: l.connect_timeout.as_secs(),
            max_audit_records: l.max_audit_records,
            routes: BTreeMap::new(),
        }
    }
}

impl EgressConfig {
    /// The per-job bounds these settings give.
    pub fn limits(&self) -> crate::egress::EgressLimits {
        crate::egress::EgressLimits {
            max_header_bytes: self.max_header_bytes.max(1024),
            max_connections: self.max_connections.max(1),
            max_total_bytes: self.max_total_mb.saturating_mul(1024 * 1024),
            idle_timeout: std::time::Duration::from_secs(self.idle_timeout_seconds.max(1)),
            connect_timeout: std::time::Duration::from_secs(self.connect_timeout_seconds.max(1)),
            max_audit_records: self.max_audit_records,
        }
    }

    /// The routes, their header values read from the node's environment.
    pub fn build_routes(&self) -> Result<crate::egress::Routes, crate::egress::routes::RouteError> {
        crate::egress::Routes::build(
            &self.routes,
            |name| std::env::var(name).ok(),
            std::time::Duration::from_secs(self.connect_timeout_seconds.max(1)),
        )
    }

    /// The proxy's resolver: `nameservers`, or the host's configuration.
    pub fn resolver(
        &self,
    ) -> Result<crate::egress::Resolver, crate::egress::resolve::ResolveError> {
        if self.nameservers.is_empty() {
            crate::egress::Resolver::system()
        } else {
            Ok(crate::egress::Resolver::with_nameservers(&self.nameservers))
        }
    }
}

/// The inference upstream. The API key never lives in this file: `api_key_file` or the
/// env variable `api_key_env` names it, and it is only ever sent to the upstream.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferenceConfig {
    /// `http://host:port` or `https://host:port` (a trailing `/v1` is accepted).
    pub base_url: String,
    /// Extra CA and client identity for an `https://` upstream (the system's roots, and
    /// `SSL_CERT_FILE`, are trusted too).
    #[serde(default)]
    pub tls: cynode_tls::ClientTls,
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The upstream takes a key per job, not one of the node's: each job's requests carry
    /// the key its dispatcher gave with the job (the request's `inference_key`, as
    /// `cynode-pm` gives its local worker for the PM's inference relay). A job without
    /// one is answered 401 `no_job_key` without a call upstream, and a session cannot ask
    /// for models. Excludes `api_key_file` and `api_key_env`.
    #[serde(default)]
    pub key_per_job: bool,
    /// Models this node offers; a job may use only those it allows and the node offers.
    /// Empty: whatever the job allows.
    #[serde(default)]
    pub models: Vec<String>,
    #[serde(default = "default_inference_request_bytes")]
    pub max_request_bytes: usize,
    #[serde(default = "default_inference_response_bytes")]
    pub max_response_bytes: usize,
    /// Bound on one upstream call.
    #[serde(default = "default_inference_timeout")]
    pub timeout_seconds: u64,
    /// Bound on an agent job's model calls (the SBA's `SBA_AGENT_MAX_TURNS`); unset: the
    /// SBA's default.
    #[serde(default)]
    pub agent_max_turns: Option<u32>,
    /// Requests one job (or session) may send to the upstream, model lists included;
    /// beyond them the proxy answers 429.
    #[serde(default = "default_inference_requests_per_job")]
    pub max_requests_per_job: u64,
}

fn default_inference_requests_per_job() -> u64 {
    256
}

fn default_inference_request_bytes() -> usize {
    1024 * 1024
}

fn default_inference_response_bytes() -> usize {
    4 * 1024 * 1024
}

fn default_inference_timeout() -> u64 {
    600
}

/// The OCI runtime an engine starts containers with. Only these names are accepted, so
/// the setting can never carry an arbitrary engine flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum OciRuntime {
    /// The engine's own default (no `--runtime`): what the engine's configuration picks.
    #[default]
    #[serde(rename = "")]
    Default,
    /// runc (crun refuses hybrid cgroup v1/v2 layouts).
    #[serde(rename = "runc")]
    Runc,
    #[serde(rename = "crun")]
    Crun,
    /// gVisor: the container's system calls are served by gVisor's own kernel in user
    /// space, not the host's. Podman runs it as `--runtime <runsc_path>` with the
    /// `--runtime-flag`s of `backend::engine::RUNSC_FLAGS`; Docker needs it registered as
    /// `runsc` in /etc/docker/daemon.json with those flags as `runtimeArgs`, as
    /// deploy/install-deps.sh does.
    #[serde(rename = "runsc")]
    Runsc,
}

impl OciRuntime {
    /// The name the config uses.
    pub fn as_str(self) -> &'static str {
        match self {
            OciRuntime::Default => "",
            OciRuntime::Runc => "runc",
            OciRuntime::Crun => "crun",
            OciRuntime::Runsc => "runsc",
        }
    }
}

/// Where Debian's `runsc` package installs gVisor's runtime.
pub const DEFAULT_RUNSC_PATH: &str = "/usr/bin/runsc";

/// Podman or Docker settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    pub binary: String,
    /// OCI runtime: `""` (the engine's default), `runc`, `crun` or `runsc` (gVisor).
    pub runtime: OciRuntime,
    /// The runsc binary Podman is given with `runtime: runsc` (Docker uses the runtime
    /// registered as `runsc` in its daemon's configuration instead).
    #[serde(default = "default_runsc_path")]
    pub runsc_path: PathBuf,
    /// The init binary `run --init` starts as PID 1 of session containers. Unset: the
    /// engine's default (Podman: `/usr/libexec/podman/catatonit`, Debian package
    /// `catatonit`; Docker: `docker-init`, Debian package `tini`). Set, Podman is given it
    /// with `--init-path`.
    #[serde(default)]
    pub init_path: Option<PathBuf>,
    /// Warm pool (`backend/engine/pool.rs`): pre-started sandboxes kept per image (and the
    /// node's limits), each serving one job and destroyed after it. 0 (the default) turns
    /// the pool off: every job is a cold `run`. At most [`MAX_POOL_SIZE`]; with
    /// `runtime: runsc` the slots are gVisor's (`backend/engine/pool/gvisor.rs`).
    #[serde(default, deserialize_with = "pool_size")]
    pub pool_size: usize,
    /// Images whose pool is filled when the node starts (before it listens); any other
    /// image's pool is filled after its first job.
    #[serde(default)]
    pub pool_images: Vec<String>,
    /// The static `cynode-pool-waiter` (deploy/worker/build-waiter.sh), PID 1 of pooled
    /// sandboxes.
    #[serde(default = "default_pool_waiter")]
    pub pool_waiter: PathBuf,
}

/// The largest `pool_size`.
pub const MAX_POOL_SIZE: usize = 16;
/// Where deploy/worker/build-waiter.sh puts the waiter.
pub const DEFAULT_POOL_WAITER: &str = "/var/cache/cynode/worker/cynode-pool-waiter";

fn default_runsc_path() -> PathBuf {
    PathBuf::from(DEFAULT_RUNSC_PATH)
}

fn default_pool_waiter() -> PathBuf {
    PathBuf::from(DEFAULT_POOL_WAITER)
}

fn pool_size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    use serde::de::Error;
    let n = usize::deserialize(d)?;
    if n > MAX_POOL_SIZE {
        return Err(D::Error::custom(format!(
            "pool_size {n} is over the maximum {MAX_POOL_SIZE}"
        )));
    }
    Ok(n)
}

/// bubblewrap settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BwrapConfig {
    pub binary: Option<String>,
    /// Image name → root filesystem directory used as `/` inside the sandbox.
    pub rootfs: BTreeMap<String, PathBuf>,
    /// Warm sandboxes (`backend/bwrap/warm.rs`): bwrap sandboxes made ahead for the
    /// workspaces that ran a job last, each serving one job. 0 (the default) turns them
    /// off. At most [`MAX_POOL_SIZE`] idle or being made; needs the node to run as root.
    #[serde(deserialize_with = "pool_size")]
    pub warm_slots: usize,
    /// The static `cynode-pool-waiter` (deploy/worker/build-waiter.sh), the command of a
    /// warm sandbox until its job comes.
    pub pool_waiter: PathBuf,
}

impl Default for BwrapConfig {
    fn default() -> Self {
        BwrapConfig {
            binary: None,
            rootfs: BTreeMap::new(),
            warm_slots: 0,
            pool_waiter: default_pool_waiter(),
        }
    }
}

/// Per-sandbox limits and API limits.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub memory_mb: u64,
    pub pids: u64,
    pub cpus: f64,
    pub tmpfs_mb: u64,
    pub default_timeout_seconds: u64,
    pub max_timeout_seconds: u64,
    /// Cap on each of stdout and stderr in a response.
    pub output_cap_bytes: usize,
    pub max_request_bytes: usize,
    /// Disk a job's /workspace and /job may use together, checked every ~200 ms while the
    /// sandbox runs and once after it ends (a job can overshoot by what it writes between
    /// two checks).
    pub disk_mb: u64,
    /// Files and directories /workspace and /job may hold together.
    pub disk_max_files: u64,
    /// Cap on result.json, read by the node.
    pub result_max_bytes: u64,
    /// Caps on the artifacts the node hashes after a job: their number, each one's size,
    /// their total size, and the time hashing may take.
    pub artifact_max_files: u64,
    pub artifact_max_file_mb: u64,
    pub artifact_max_total_mb: u64,
    pub artifact_hash_seconds: u64,
    /// Connections each per-job socket (`/job/status.sock`, `/job/inference.sock`) holds
    /// at once.
    pub job_socket_connections: usize,
    /// The output a streamed session exec keeps, per stream (stdout, stderr): the newest
    /// bytes; older ones are cut and named as cut to a reader
    /// ([`crate::sessions::stream`]).
    pub exec_output_ring_bytes: usize,
}

/// Async job backpressure.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// Jobs running at once.
    pub max_running: usize,
    /// Jobs waiting beyond those; more are refused with 503.
    pub max_queued: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9190)),
            token_file: None,
            backend: BackendKind::Podman,
            state_dir: PathBuf::from("/var/lib/cynode-worker"),
            podman: EngineConfig {
                binary: "podman".into(),
                runtime: OciRuntime::Runc,
                ..EngineConfig::default()
            },
            docker: EngineConfig {
                binary: "docker".into(),
                ..EngineConfig::default()
            },
            bwrap: BwrapConfig::default(),
            microvm: microvm::MicrovmConfig::default(),
            images: Vec::new(),
            limits: Limits::default(),
            queue: QueueConfig::default(),
            seed_roots: Vec::new(),
            seed_exclude_dirs: [
                "node_modules",
                "target",
                ".venv",
                "venv",
                "__pycache__",
                ".gradle",
                ".m2",
                ".cache",
                ".tox",
                ".mypy_cache",
                ".pytest_cache",
            ]
            .map(String::from)
            .to_vec(),
            retention_seconds: 7 * 24 * 3600,
            inference: None,
            tls: None,
            default_image: None,
            allow_unlabelled_agent_images: false,
            allow_plain_http: false,
            listener: cynode_tls::ListenerLimits::default(),
            egress: EgressConfig::default(),
            sandbox_uids: sandbox_uids::UidRange::default(),
            gateway: GatewayConfig::default(),
            session_state: session_state::SessionStateConfig::default(),
        }
    }
}

fn podman_engine<'de, D: serde::Deserializer<'de>>(d: D) -> Result<EngineConfig, D::Error> {
    engine_over(d, Config::default().podman)
}

fn docker_engine<'de, D: serde::Deserializer<'de>>(d: D) -> Result<EngineConfig, D::Error> {
    engine_over(d, Config::default().docker)
}

/// An engine's section over that engine's own defaults: a key the section leaves out
/// (`docker: {runtime: runsc}`) keeps the engine's value (binary `docker`), where a plain
/// `#[serde(default)]` would take [`EngineConfig::default`]'s (Podman's).
fn engine_over<'de, D: serde::Deserializer<'de>>(
    d: D,
    defaults: EngineConfig,
) -> Result<EngineConfig, D::Error> {
    use serde::de::Error;
    let given = serde_yaml::Value::deserialize(d)?;
    let mut merged = serde_yaml::to_value(&defaults).map_err(D::Error::custom)?;
    match (&mut merged, given) {
        (serde_yaml::Value::Mapping(base), serde_yaml::Value::Mapping(over)) => {
            for (k, v) in over {
                base.insert(k, v);
            }
        }
        (_, serde_yaml::Value::Null) => {}
        (_, other) => merged = other,
    }
    let cfg = EngineConfig::deserialize(merged).map_err(D::Error::custom)?;
    for image in &cfg.pool_images {
        crate::image_ref::check(image)
            .map_err(|e| D::Error::custom(format!("pool_images: image {image}: {e}")))?;
    }
    Ok(cfg)
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            binary: "podman".into(),
            runtime: OciRuntime::Default,
            runsc_path: default_runsc_path(),
            init_path: None,
            pool_size: 0,
            pool_images: Vec::new(),
            pool_waiter: default_pool_waiter(),
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_mb: 512,
            pids: 256,
            cpus: 1.0,
            tmpfs_mb: 64,
            default_timeout_seconds: DEFAULT_TIMEOUT_SECONDS,
            max_timeout_seconds: MAX_TIMEOUT_SECONDS,
            output_cap_bytes: DEFAULT_OUTPUT_CAP_BYTES,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            disk_mb: 10 * 1024,
            disk_max_files: 100_000,
            result_max_bytes: 16 * 1024 * 1024,
            artifact_max_files: 1000,
            artifact_max_file_mb: 1024,
            artifact_max_total_mb: 2048,
            artifact_hash_seconds: 60,
            job_socket_connections: 16,
            exec_output_ring_bytes: 1024 * 1024,
        }
    }
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_running: 2,
            max_queued: 64,
        }
    }
}

impl Limits {
    /// The upstream rule: min(requested or default, max).
    pub fn effective_timeout(&self, requested: Option<u64>) -> u64 {
        requested
            .unwrap_or(self.default_timeout_seconds)
            .min(self.max_timeout_seconds)
            .max(1)
    }
}

/// Why the configuration or the token cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {}", .0.display())]
    Read(PathBuf, #[source] std::io::Error),
    #[error("invalid config {}", .0.display())]
    Invalid(PathBuf, #[source] serde_yaml::Error),
    #[error("cannot read token file {}", .0.display())]
    TokenFile(PathBuf, #[source] std::io::Error),
    #[error("no usable bearer token: give --token-file or WORKER_API_BEARER_TOKEN (at least 16 characters)")]
    NoToken,
}

/// Why an image may not run on this node; the message is for the `image` field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageRefused {
    #[error("image {0}")]
    Reference(#[from] crate::image_ref::ImageRefError),
    #[error("image `{0}` is not in this node's image allowlist")]
    NotAllowed(String),
}

impl Config {
    /// Reads a YAML file; unknown keys are errors.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| ConfigError::Read(path.to_path_buf(), e))?;
        let cfg: Config =
            serde_yaml::from_str(&text).map_err(|e| ConfigError::Invalid(path.to_path_buf(), e))?;
        Ok(cfg)
    }

    /// The token: the token file if configured, else `WORKER_API_BEARER_TOKEN`.
    pub fn token(&self) -> Result<String, ConfigError> {
        let token = match &self.token_file {
            Some(p) => {
                let text =
                    std::fs::read_to_string(p).map_err(|e| ConfigError::TokenFile(p.clone(), e))?;
                cynode_protocol::bearer::token_in_file(&text).to_string()
            }
            None => std::env::var("WORKER_API_BEARER_TOKEN").unwrap_or_default(),
        };
        if token.len() < 16 {
            return Err(ConfigError::NoToken);
        }
        Ok(token)
    }

    /// Directory of per-job directories.
    pub fn jobs_dir(&self) -> PathBuf {
        self.state_dir.join("jobs")
    }

    /// Directory of per-task workspaces.
    pub fn workspaces_dir(&self) -> PathBuf {
        self.state_dir.join("workspaces")
    }

    /// Pristine copies of seeded workspaces without git, for changesets.
    pub fn baselines_dir(&self) -> PathBuf {
        self.state_dir.join("baselines")
    }

    /// Where workspace snapshots' images are kept (no sandbox mounts it).
    pub fn snapshots_dir(&self) -> PathBuf {
        self.state_dir.join("snapshots")
    }

    /// The node's SQLite database.
    pub fn database_path(&self) -> PathBuf {
        self.state_dir.join("worker.db")
    }

    /// Whether `image` may run here: a valid OCI reference, and in the allowlist if one is
    /// set.
    pub fn image_allowed(&self, image: &str) -> bool {
        self.check_image(image).is_ok()
    }

    /// Why `image` may not run here (a message for the `image` field), if it may not.
    pub fn check_image(&self, image: &str) -> Result<(), ImageRefused> {
        crate::image_ref::check(image)?;
        if self.images.is_empty() || self.images.iter().any(|i| i == image) {
            Ok(())
        } else {
            Err(ImageRefused::NotAllowed(image.to_string()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_rule_matches_upstream() {
        let l = Limits::default();
        assert_eq!(l.effective_timeout(None), 3600);
        assert_eq!(l.effective_timeout(Some(20000)), 10800);
        assert_eq!(l.effective_timeout(Some(5)), 5);
    }

    #[test]
    fn yaml_rejects_unknown_keys_and_fills_defaults() {
        let cfg: Config = serde_yaml::from_str("backend: bwrap\nlimits:\n  pids: 32\n").unwrap();
        assert_eq!(cfg.backend, BackendKind::Bwrap);
        assert_eq!(cfg.limits.pids, 32);
        assert_eq!(cfg.limits.memory_mb, 512);
        assert!(serde_yaml::from_str::<Config>("bakend: bwrap\n").is_err());
    }

    #[test]
    fn runtime_is_one_of_the_known_names() {
        let cfg: Config =
            serde_yaml::from_str("podman:\n  runtime: runsc\ndocker:\n  runtime: \"\"\n").unwrap();
        assert_eq!(cfg.podman.runtime, OciRuntime::Runsc);
        assert_eq!(cfg.podman.runsc_path, Path::new(DEFAULT_RUNSC_PATH));
        assert_eq!(cfg.docker.runtime, OciRuntime::Default);
        assert_eq!(Config::default().podman.runtime, OciRuntime::Runc);
        // A section that names only some keys keeps its own engine's defaults.
        assert_eq!(cfg.podman.binary, "podman");
        assert_eq!(cfg.docker.binary, "docker");
        let cfg: Config = serde_yaml::from_str("podman:\n  binary: /opt/podman\n").unwrap();
        assert_eq!(cfg.podman.runtime, OciRuntime::Runc);
        assert!(serde_yaml::from_str::<Config>("docker:\n  binry: x\n").is_err());
        for bad in ["--privileged", "/usr/bin/runsc", "runsc --debug", "gvisor"] {
            let text = format!("podman:\n  runtime: \"{bad}\"\n");
            assert!(serde_yaml::from_str::<Config>(&text).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn egress_section_parses_its_patterns_and_refuses_bad_ones() {
        let cfg: Config = serde_yaml::from_str(
            "egress:\n  allow: [\"pypi.org\", \"*.pythonhosted.org\", \"10.0.0.5:3141\"]\n  nameservers: [\"127.0.0.1:5353\"]\n  max_connections: 8\n",
        )
        .unwrap();
        assert_eq!(cfg.egress.allow.patterns.len(), 3);
        assert_eq!(cfg.egress.limits().max_connections, 8);
        assert_eq!(cfg.egress.limits().max_header_bytes, 32 * 1024);
        assert!(Config::default().egress.allow.patterns.is_empty());
        let bad = serde_yaml::from_str::<Config>("egress:\n  allow: [\"a.*.com\"]\n");
        assert!(bad.unwrap_err().to_string().contains("wildcard"));
        assert!(serde_yaml::from_str::<Config>("egress:\n  alow: []\n").is_err());
        let routes: Config = serde_yaml::from_str(
            "egress:\n  routes:\n    git:\n      upstream: https://git.example/api\n      headers:\n        PRIVATE-TOKEN: {env: GIT_TOKEN}\n",
        )
        .unwrap();
        assert_eq!(
            routes.egress.routes["git"].headers["PRIVATE-TOKEN"].env,
            "GIT_TOKEN"
        );
    }

    #[test]
    fn no_image_is_a_flag_even_without_an_allowlist() {
        let mut cfg = Config::default();
        assert!(cfg.images.is_empty());
        assert!(cfg.image_allowed("localhost/cynode-sba-test:latest"));
        for bad in ["--volume=/:/host:rw", "-v", "--privileged", "", "a b"] {
            assert!(!cfg.image_allowed(bad), "{bad:?}");
        }
        cfg.images = vec!["alpine:3".into(), "--privileged".into()];
        assert!(cfg.image_allowed("alpine:3"));
        assert!(!cfg.image_allowed("alpine:4"));
        assert!(
            !cfg.image_allowed("--privileged"),
            "a listed flag is still refused"
        );
        assert!(cfg
            .check_image("alpine:4")
            .unwrap_err()
            .to_string()
            .contains("allowlist"));
        assert!(cfg
            .check_image("-v")
            .unwrap_err()
            .to_string()
            .contains("OCI image reference"));
    }
}
