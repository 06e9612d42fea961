//! The flag groups several commands share, each turned into plain settings of
//! [`cynode_pm::config`]: the model, the workers, the state, the local worker and the
//! session's budgets. A command flattens only the groups it uses, so `serve` refuses
//! `--local-backend` and `sessions list` refuses model flags.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use cynode_pm::config::{
    LocalInference, LocalWorkerConfig, PmConfig, PolicySource, RemoteWorker, SkillSources,
    WorkersConfig,
};
use cynode_pm::llm::ModelConfig;
use cynode_pm::session::Budgets;

use super::Global;

/// The OpenAI-compatible model.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// OpenAI-compatible endpoint, e.g. http://127.0.0.1:8089/v1.
    #[arg(
        long,
        env = "CYNODE_MODEL_BASE_URL",
        default_value = "http://127.0.0.1:8089/v1"
    )]
    pub model_base_url: String,
    /// openai-compatible (the only provider protocol spoken).
    #[arg(long, default_value = "openai-compatible")]
    pub model_provider: String,
    #[arg(long, env = "CYNODE_MODEL_NAME", default_value = "smollm2")]
    pub model_name: String,
    #[arg(long, default_value_t = 1024)]
    pub max_tokens: u32,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// How long one model request may take; a reply is asked at most 3 times on
    /// timeouts and transport errors, so a model that never answers fails the session
    /// after about 3 × this.
    #[arg(long, env = "CYNODE_MODEL_TIMEOUT_SECONDS", default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub model_timeout_seconds: u64,
    /// PEM file of extra CA certificates to trust for an https:// model endpoint (the
    /// system's roots, and SSL_CERT_FILE, are trusted too).
    #[arg(long, env = "CYNODE_MODEL_CA_FILE")]
    pub ca_file: Option<PathBuf>,
}

impl ModelArgs {
    /// The local worker's inference upstream for this model: the model itself when it
    /// takes no key, else `relay` (see [`RunArgs::local_inference`]).
    pub fn local_inference(
        &self,
        relay: Option<&cynode_pm::inference_relay::Relay>,
    ) -> Option<LocalInference> {
        if ModelConfig::api_key_from_env().is_none() {
            return Some(LocalInference {
                base_url: self.model_base_url.clone(),
                ca_file: self.ca_file.clone(),
                key_per_job: false,
            });
        }
        let Some(relay) = relay else {
            tracing::info!(
                "the local worker gets no inference upstream: the model takes a key, which does not leave the PM, and no relay runs; agent jobs on it are refused"
            );
            return None;
        };
        Some(LocalInference {
            base_url: relay.url().to_string(),
            ca_file: None,
            key_per_job: true,
        })
    }
}

/// The workers jobs go to.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Worker")]
pub struct WorkerArgs {
    /// A running worker; without it (and without --workers-file) `run` starts and stops a
    /// local cynode-worker.
    #[arg(long, env = "CYNODE_WORKER_ENDPOINT", conflicts_with = "workers_file")]
    pub worker_endpoint: Option<String>,
    /// PEM file of extra CA certificates to trust for an https:// --worker-endpoint (the
    /// system's roots are trusted too).
    #[arg(long, requires = "worker_endpoint")]
    pub worker_ca_file: Option<PathBuf>,
    /// PEM client certificate presented to a --worker-endpoint that requires one (mutual
    /// TLS); needs --worker-client-key.
    #[arg(long, requires_all = ["worker_endpoint", "worker_client_key"])]
    pub worker_client_cert: Option<PathBuf>,
    /// PEM private key of --worker-client-cert.
    #[arg(long, requires_all = ["worker_endpoint", "worker_client_cert"])]
    pub worker_client_key: Option<PathBuf>,
    /// Allows a plain http:// --worker-endpoint on a non-loopback host (the worker token
    /// then crosses the network in clear); a workers file says `allow_plain_http: true`
    /// per entry instead.
    #[arg(long, requires = "worker_endpoint")]
    pub allow_plain_http_worker: bool,
    /// The worker registry: a YAML file listing several workers with their tokens,
    /// purposes, images and capacity (see docs and `cynode_pm::workers`).
    #[arg(long, env = "CYNODE_WORKERS_FILE")]
    pub workers_file: Option<PathBuf>,
    /// How long a session's first job waits for a worker offering its purpose to answer
    /// before the session fails worker_unavailable.
    #[arg(long, default_value_t = 60)]
    pub worker_wait_seconds: u64,
    /// File with the worker's bearer token (else CYNODE_WORKER_TOKEN).
    #[arg(long)]
    pub worker_token_file: Option<PathBuf>,
    /// Sandbox image jobs run in (with --worker-endpoint or the local worker; a workers
    /// file names an image per purpose).
    /// An empty value (e.g. `CYNODE_SANDBOX_IMAGE=`) is refused here, not by the worker.
    #[arg(
        long,
        env = "CYNODE_SANDBOX_IMAGE",
        default_value = "localhost/cynode-sba-test:latest",
        value_parser = clap::builder::NonEmptyStringValueParser::new()
    )]
    pub sandbox_image: String,
}

/// Where the PM keeps its state.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "State")]
pub struct StoreArgs {
    /// Where the PM keeps its database and artifacts.
    #[arg(long, env = "CYNODE_STATE_DIR", default_value = ".cynode")]
    pub state_dir: PathBuf,
    /// sqlite://PATH (default: <state-dir>/pm.db) or postgres://…
    #[arg(long, env = "CYNODE_DATASTORE_ENDPOINT")]
    pub datastore_endpoint: Option<String>,
}

/// The worker `run` starts itself when none is given.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Local worker")]
pub struct LocalWorkerArgs {
    /// Backend of the local worker.
    #[arg(long, default_value = "podman")]
    pub local_backend: String,
    /// bwrap root filesystem of the sandbox image (local worker with --local-backend bwrap).
    #[arg(long)]
    pub local_bwrap_rootfs: Option<PathBuf>,
    /// How long the local worker outlives this PM when it is killed (kill -9, Ctrl-C):
    /// its running job finishes and `sessions resume` gets the result. Nothing is left
    /// running after it.
    #[arg(long, env = "CYNODE_LOCAL_WORKER_GRACE_SECONDS", default_value_t = 600)]
    pub local_worker_grace_seconds: u64,
}

/// What every command that builds a PM takes: the model, the workers, the state.
#[derive(Debug, Clone, Args)]
pub struct PmArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub workers: WorkerArgs,
    #[command(flatten)]
    pub store: StoreArgs,
}

/// The flags and environment of `run` and `sessions resume`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub pm: PmArgs,
    #[command(flatten)]
    pub local: LocalWorkerArgs,
    // Explicit headings: a struct-level one would be overridden by the flattened groups.
    /// The tenant the session runs as (its policy settings: --tenant).
    #[arg(
        long,
        env = "CYNODE_TENANT_ID",
        default_value = "default",
        help_heading = "Session"
    )]
    pub tenant_id: String,
    /// Model turns the session may take.
    #[arg(long, default_value_t = 30, help_heading = "Session")]
    pub max_turns: u32,
    /// Jobs the session may dispatch.
    #[arg(long, default_value_t = 20, help_heading = "Session")]
    pub max_jobs: u32,
    /// Lets this session's jobs reach HOST (`host`, `*.suffix`, optional `:port`) through
    /// the worker's egress proxy, on top of the tenant's `egress.allow` (repeatable). The
    /// worker's own `egress.allow` still bounds it.
    #[arg(long = "egress-allow", value_name = "HOST", help_heading = "Session")]
    pub egress_allow: Vec<String>,
    /// Where this run hosts the sandbox gateway for its session's jobs that list tools
    /// (MCP, job tokens; as `serve`'s `/v1/gateway`). The default, a free loopback port,
    /// serves a local worker or one on this machine. Without --gateway-tls-cert the
    /// gateway speaks plain HTTP: a non-loopback address is then refused without
    /// --gateway-allow-plain-http.
    #[arg(
        long,
        env = "CYNODE_RUN_GATEWAY_LISTEN",
        default_value = "127.0.0.1:0",
        help_heading = "Session"
    )]
    pub gateway_listen: std::net::SocketAddr,
    /// The gateway's URL (http:// or https://, e.g. a TLS proxy in front of it) as the
    /// workers reach it; default: `http://<listen>/v1/gateway` when the listen address is
    /// a loopback one and the worker is local or on loopback (otherwise jobs get no
    /// gateway, warned).
    #[arg(long, env = "CYNODE_RUN_GATEWAY_URL", help_heading = "Session")]
    pub gateway_url: Option<String>,
    /// Accept a non-loopback --gateway-listen although the gateway speaks plain HTTP (job
    /// tokens then cross the network in clear: a trusted network only).
    #[arg(long, help_heading = "Session")]
    pub gateway_allow_plain_http: bool,
    /// PEM certificate (chain): the hosted gateway speaks HTTPS (reloaded when the file
    /// changes; `serve`'s TLS) and may listen beyond loopback. Its URL then defaults to
    /// `https://<listen>/v1/gateway`. A worker must trust its issuer: this run's local
    /// worker trusts the system's roots and SSL_CERT_FILE, which it inherits.
    #[arg(long, requires = "gateway_tls_key", help_heading = "Session")]
    pub gateway_tls_cert: Option<PathBuf>,
    /// PEM private key of --gateway-tls-cert.
    #[arg(long, requires = "gateway_tls_cert", help_heading = "Session")]
    pub gateway_tls_key: Option<PathBuf>,
    /// The gateway's egress settings (as `serve`'s --gateway-egress-file): `api.call`'s
    /// credentialed routes, `web.fetch`'s name servers, extra CA and bounds, `web.search`'s
    /// route.
    #[arg(long, env = "CYNODE_RUN_GATEWAY_EGRESS_FILE", help_heading = "Session")]
    pub gateway_egress_file: Option<PathBuf>,
    /// Host no sandbox gateway: no job of this run gets a token, whatever it lists.
    #[arg(long, help_heading = "Session")]
    pub no_gateway: bool,
    /// Largest request the hosted gateway accepts (an 8 MiB `artifact.put`, base64).
    #[arg(long, default_value_t = 12 << 20, help_heading = "Session")]
    pub gateway_max_body_bytes: usize,
}

impl RunArgs {
    pub fn budgets(&self) -> Budgets {
        Budgets {
            max_turns: self.max_turns,
            max_jobs: self.max_jobs,
            ..Budgets::default()
        }
    }

    /// Where this run's jobs may go at most: the tenant's `egress.allow` and
    /// `--egress-allow`, sorted, without duplicates (the local worker's `egress.allow`).
    pub fn egress_ceiling(&self, global: &Global) -> anyhow::Result<Vec<String>> {
        let tenant = cynode_pm::bootstrap::tenant(global.tenant.as_deref())?;
        let all: std::collections::BTreeSet<String> = tenant
            .egress
            .allow
            .into_iter()
            .chain(self.egress_allow.iter().cloned())
            .collect();
        Ok(all.into_iter().collect())
    }

    /// The local worker's inference upstream: this run's model, or, when that model takes
    /// a key (`CYNODE_MODEL_API_KEY`), the run's inference `relay` (the key stays the
    /// PM's; the worker gets the relay's URL and token). A keyed model without a relay:
    /// none (agent jobs on the worker are refused).
    pub fn local_inference(
        &self,
        relay: Option<&cynode_pm::inference_relay::Relay>,
    ) -> Option<LocalInference> {
        self.pm.model.local_inference(relay)
    }

    /// The local worker of this run, its workspaces seeded from `seed`, its egress
    /// ceiling [`Self::egress_ceiling`].
    pub fn local_worker(
        &self,
        global: &Global,
        seed: Option<PathBuf>,
        relay: Option<&cynode_pm::inference_relay::Relay>,
    ) -> anyhow::Result<LocalWorkerConfig> {
        self.local.config(
            global,
            &self.pm.store,
            &self.pm.workers,
            seed,
            self.egress_ceiling(global)?,
            self.local_inference(relay),
        )
    }
}

impl LocalWorkerArgs {
    /// The local worker these flags describe: its state under `store`'s directory, jobs
    /// on `workers`' sandbox image, workspaces seeded from `seed`, reaching at most
    /// `egress_allow`, inference through `inference` (none: agent jobs are refused).
    pub fn config(
        &self,
        global: &Global,
        store: &StoreArgs,
        workers: &WorkerArgs,
        seed: Option<PathBuf>,
        egress_allow: Vec<String>,
        inference: Option<LocalInference>,
    ) -> anyhow::Result<LocalWorkerConfig> {
        use anyhow::Context;
        let exe = std::env::current_exe().context("cannot find the cynode-pm executable")?;
        Ok(LocalWorkerConfig {
            program: exe.with_file_name("cynode-worker"),
            state_dir: store.state_dir.clone(),
            backend: self.local_backend.clone(),
            bwrap_rootfs: self.local_bwrap_rootfs.clone(),
            image: workers.sandbox_image.clone(),
            seed,
            egress_allow,
            otlp_endpoint: global.otlp_endpoint.clone(),
            inference,
            keeper: exe.clone(),
            grace: Duration::from_secs(self.local_worker_grace_seconds),
        })
    }
}

impl PmArgs {
    /// The settings of the PM these flags (and the global ones) describe.
    pub fn config(&self, global: &Global) -> PmConfig {
        let model = &self.model;
        let mut m = ModelConfig::new(&model.model_base_url, &model.model_name);
        m.max_tokens = model.max_tokens;
        m.temperature = model.temperature;
        m.timeout = Duration::from_secs(model.model_timeout_seconds);
        m.ca_file = model.ca_file.clone();
        PmConfig {
            model: m,
            state_dir: self.store.state_dir.clone(),
            datastore: self.store.datastore_endpoint.clone(),
            skills: skill_sources(global),
            policy: policy_source(global),
            tenant_file: global.tenant.clone(),
            worker_wait: Duration::from_secs(self.workers.worker_wait_seconds),
        }
    }
}

pub fn skill_sources(global: &Global) -> SkillSources {
    SkillSources {
        dirs: global.skill_dirs.clone(),
        no_builtin: global.no_builtin_skills,
    }
}

pub fn policy_source(global: &Global) -> PolicySource {
    match (&global.policy_endpoint, &global.policy_dir) {
        (Some(url), _) => PolicySource::Remote(url.clone()),
        (None, Some(dir)) => PolicySource::Dir(dir.clone()),
        (None, None) => PolicySource::Builtin,
    }
}

impl WorkerArgs {
    /// The workers these flags name; `None` when neither --workers-file nor
    /// --worker-endpoint is given (`run` then starts a local worker).
    pub fn config(&self) -> anyhow::Result<Option<WorkersConfig>> {
        if let Some(path) = &self.workers_file {
            return Ok(Some(WorkersConfig::File(path.clone())));
        }
        let Some(endpoint) = &self.worker_endpoint else {
            return Ok(None);
        };
        let tls = cynode_tls::ClientTls {
            ca_file: self.worker_ca_file.clone(),
            cert_file: self.worker_client_cert.clone(),
            key_file: self.worker_client_key.clone(),
        };
        cynode_pm::workers::check_endpoint(
            endpoint,
            !tls.is_default(),
            self.allow_plain_http_worker,
            "--allow-plain-http-worker",
        )
        .map_err(|e| anyhow::anyhow!("--worker-endpoint: {e}"))?;
        Ok(Some(WorkersConfig::Endpoint(RemoteWorker {
            endpoint: endpoint.clone(),
            tls,
            allow_plain_http: self.allow_plain_http_worker,
            token_file: self.worker_token_file.clone(),
            image: self.sandbox_image.clone(),
        })))
    }
}
