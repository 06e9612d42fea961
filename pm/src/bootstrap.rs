//! Builds a PM ([`Pm`]) from its settings ([`crate::config`]): the datastore, the skill
//! registry, the policy gate, the tenant policy, the worker pool and the model client.
//!
//! Architecture invariant: this module knows no command-line parser and prints nothing;
//! every failure is a [`BootstrapError`] that names what could not be set up.

use std::path::Path;

use crate::config::{PmConfig, PolicySource, RemoteWorker, SkillSources, WorkersConfig};
use crate::dispatch::WorkerClient;
use crate::driver::Pm;
use crate::llm::{Contract, ContractError, LlmClient};
use crate::policy::{Mode, PolicyError, PolicyGate, TenantPolicy};
use crate::settings_file::FileError;
use crate::skills::{Registry, SkillError};
use crate::store::{Store, StoreError};
use crate::workers::{WorkerPool, WorkersError};

/// What could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("cannot create the state directory {}: {cause}", path.display())]
    StateDir {
        path: std::path::PathBuf,
        cause: std::io::Error,
    },
    #[error("cannot open the datastore {url}: {cause}")]
    Datastore { url: String, cause: StoreError },
    #[error("cannot load skills:\n{}", .0.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
    Skills(Vec<SkillError>),
    #[error("cannot load policy from {}: {cause}", dir.display())]
    PolicyDir {
        dir: std::path::PathBuf,
        cause: PolicyError,
    },
    #[error("built-in policy: {0}")]
    BuiltinPolicy(PolicyError),
    #[error(transparent)]
    Tenant(#[from] FileError<serde_yaml::Error>),
    #[error(transparent)]
    WorkersFile(#[from] FileError<WorkersError>),
    #[error(transparent)]
    Workers(#[from] WorkersError),
    #[error("no worker offers the sandbox purpose of any skill (offered: {0})")]
    NoRunnableSkill(String),
    #[error(transparent)]
    Contract(#[from] ContractError),
}

/// The skills of `sources`: the built-in ones with `dirs` on top, or only `dirs`'s.
/// Every problem of every package is returned, not only the first.
pub fn registry(sources: &SkillSources) -> Result<Registry, Vec<SkillError>> {
    if sources.no_builtin {
        Registry::load(&sources.dirs)
    } else {
        Registry::builtin_with(&sources.dirs)
    }
}

/// [`registry`], every problem in one error.
pub fn load_registry(sources: &SkillSources) -> Result<Registry, BootstrapError> {
    registry(sources).map_err(BootstrapError::Skills)
}

/// The policy gate of `source` in `mode`.
pub fn gate(source: &PolicySource, mode: Mode) -> Result<PolicyGate, BootstrapError> {
    Ok(match source {
        PolicySource::Remote(url) => PolicyGate::remote(url, "cynode/policy", mode),
        PolicySource::Dir(dir) => {
            PolicyGate::local_from_dir(dir, mode).map_err(|cause| BootstrapError::PolicyDir {
                dir: dir.clone(),
                cause,
            })?
        }
        PolicySource::Builtin => {
            PolicyGate::builtin(mode).map_err(BootstrapError::BuiltinPolicy)?
        }
    })
}

/// The tenant policy of `file` (YAML or JSON); the default one without a file.
pub fn tenant(file: Option<&Path>) -> Result<TenantPolicy, BootstrapError> {
    let Some(path) = file else {
        return Ok(TenantPolicy::default());
    };
    Ok(crate::settings_file::load("tenant file", path, |t| {
        serde_yaml::from_str(t)
    })?)
}

/// The worker pool of `config`, reading tokens and TLS files now.
pub fn workers(config: &WorkersConfig) -> Result<WorkerPool, BootstrapError> {
    match config {
        WorkersConfig::File(path) => {
            let file = crate::workers::WorkersFile::load(path)?;
            Ok(WorkerPool::from_file(&file)?)
        }
        WorkersConfig::Endpoint(w) => Ok(WorkerPool::single(remote_client(w)?, &w.image)),
    }
}

fn remote_client(w: &RemoteWorker) -> Result<WorkerClient, WorkersError> {
    let token = crate::workers::read_token(
        "the worker endpoint",
        w.token_file.as_deref(),
        Some("CYNODE_WORKER_TOKEN"),
    )?;
    WorkerClient::with_tls(&w.endpoint, &token, &w.tls).map_err(|cause| WorkersError::Tls {
        id: "endpoint".into(),
        cause,
    })
}

/// Builds the PM of `config` placing jobs on `workers`. The model (and `GET /v1/skills`)
/// is offered only the skills some worker can run; no runnable skill at all is an error.
pub async fn build_pm(config: &PmConfig, workers: WorkerPool) -> Result<Pm, BootstrapError> {
    std::fs::create_dir_all(&config.state_dir).map_err(|cause| BootstrapError::StateDir {
        path: config.state_dir.clone(),
        cause,
    })?;
    let url = config.datastore_url();
    let store = Store::connect(&url)
        .await
        .map_err(|cause| BootstrapError::Datastore {
            url: url.clone(),
            cause,
        })?;
    let registry = load_registry(&config.skills)?;
    let catalog = registry.catalog_of(|skill| {
        let m = &skill.manifest;
        let runnable = workers.offers(&m.purpose);
        if !runnable {
            tracing::warn!(skill_id = %m.skill_id, purpose = %m.purpose, "no worker offers this skill's sandbox purpose; the model is not offered it");
        }
        runnable
    });
    if catalog.is_empty() && registry.iter().next().is_some() {
        return Err(BootstrapError::NoRunnableSkill(
            workers.offered().join(", "),
        ));
    }
    let mut model = config.model.clone();
    if model.api_key.is_none() {
        model.api_key = crate::llm::ModelConfig::api_key_from_env();
    }
    Ok(Pm {
        contract: Contract::new(catalog)?,
        registry,
        store,
        gate: gate(&config.policy, Mode::Enforce)?,
        tenant: tenant(config.tenant_file.as_deref())?,
        llm: LlmClient::new(model),
        workers,
        worker_wait: config.worker_wait,
        artifacts_dir: config.artifacts_dir(),
        gateway_url: None,
    })
}
