//! One job's egress, from its request to its audit: [`policy`] checks the request against
//! the node (`restricted` with egress off is deny-all, no network; with egress on it needs
//! a backend that can bind the proxy inside the sandbox; `sandbox.egress_allow` may narrow
//! the node's ceiling, never widen it), [`env`] gives the variables the sandbox gets, and
//! a [`JobEgress`] binds the proxy's listener at [`PROXY_ADDR`] inside the sandbox's
//! network namespace (through the backend's [`NetnsHook`]) before the sandbox's command
//! runs, and returns its audit when the job ends.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use cynode_protocol::egress::EgressAudit;
use cynode_protocol::worker_api::{NetworkPolicy, RunJobRequest};
use cynode_protocol::ValidationError;

use crate::backend::netns_gate::NetnsHook;
use crate::config::{Config, EgressConfig};
use crate::egress::netns::Netns;
use crate::egress::{EgressLimits, EgressProxy, Policy, Resolver, Routes, SandboxLoopback};

/// Where the proxy listens inside the sandbox's own network namespace.
pub const PROXY_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 3128);
/// `HTTP_PROXY` and friends inside the sandbox.
pub const PROXY_URL: &str = "http://127.0.0.1:3128";
/// `CYNODE_EGRESS_ROUTES_URL`: the credentialed routes, `<this>/<name>/…`.
pub const ROUTES_URL: &str = "http://127.0.0.1:3128/routes";
/// `NO_PROXY`: the sandbox's own loopback is never sent to the proxy.
pub const NO_PROXY: &str = "localhost,127.0.0.1";

/// What every job's proxy of a node shares: the resolver, the routes (their secrets read
/// from the node's environment once, at start) and the bounds.
#[derive(Debug)]
pub struct NodeEgress {
    resolver: Resolver,
    routes: Arc<Routes>,
    limits: EgressLimits,
}

/// Why the node cannot offer egress as configured.
#[derive(Debug, thiserror::Error)]
pub enum EgressStartError {
    #[error("egress: {0}")]
    Routes(#[from] crate::egress::routes::RouteError),
    #[error("egress: {0}")]
    Resolver(#[from] crate::egress::resolve::ResolveError),
}

impl NodeEgress {
    /// `None` when the node allows no destination and has no route (egress is off).
    pub fn from_config(cfg: &EgressConfig) -> Result<Option<Arc<NodeEgress>>, EgressStartError> {
        if cfg.allow.patterns.is_empty() && cfg.routes.is_empty() {
            return Ok(None);
        }
        Ok(Some(Arc::new(NodeEgress {
            resolver: cfg.resolver()?,
            routes: Arc::new(cfg.build_routes()?),
            limits: cfg.limits(),
        })))
    }

    /// The bounds every proxy of the node gets (a session's bubblewrap commands share
    /// its byte budget: [`JobEgress::with_byte_budget`]).
    pub fn limits(&self) -> &EgressLimits {
        &self.limits
    }
}

/// The field every refusal names.
const FIELD: &str = "sandbox.network_policy";

/// The job's proxy policy: `None` for a job without network (`none`, the default, and
/// `restricted` on a node with egress off, which is upstream's deny-all); `restricted` is
/// refused on a node with egress on whose backend cannot bind the proxy inside its
/// sandboxes, as is an `egress_allow` naming destinations the node does not offer (beyond
/// its ceiling, or any at all when egress is off).
pub fn policy(cfg: &Config, req: &RunJobRequest) -> Result<Option<Policy>, ValidationError> {
    if req.sandbox.network_policy.unwrap_or_default() != NetworkPolicy::Restricted {
        return Ok(None);
    }
    if cfg.egress.allow.patterns.is_empty() && cfg.egress.routes.is_empty() {
        // Upstream's meaning of `restricted` without a proxy: deny-all. The job runs with
        // no network at all, as `none`; only a request that names destinations is refused,
        // since the node cannot give it what it asks for.
        if req
            .sandbox
            .egress_allow
            .as_ref()
            .is_some_and(|l| !l.is_empty())
        {
            return Err(ValidationError::new(
                "sandbox.egress_allow",
                "this node allows no destination (worker.yaml egress.allow is empty): \
                 `restricted` runs here with no network at all",
            ));
        }
        return Ok(None);
    }
    if !crate::backend::can_gate(cfg) {
        return Err(ValidationError::new(
            FIELD,
            format!(
                "`restricted` is not offered on this node's backend ({}): its sandboxes \
                 cannot reach the egress proxy; use bwrap, or podman or docker with runc/crun",
                crate::backend::describe(cfg),
            ),
        ));
    }
    Policy::for_job(&cfg.egress.allow, req.sandbox.egress_allow.as_deref())
        .map(Some)
        .map_err(|e| ValidationError::new("sandbox.egress_allow", e.to_string()))
}

/// The variables a job with a proxy gets (none for a job without).
pub fn env(with_proxy: bool) -> Vec<(&'static str, String)> {
    if !with_proxy {
        return Vec::new();
    }
    let mut env: Vec<(&'static str, String)> =
        ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"]
            .into_iter()
            .map(|k| (k, PROXY_URL.to_string()))
            .collect();
    env.push(("NO_PROXY", NO_PROXY.into()));
    env.push(("no_proxy", NO_PROXY.into()));
    env.push(("CYNODE_EGRESS_ROUTES_URL", ROUTES_URL.into()));
    env
}

/// One job's proxy: started by [`JobEgress::hook`] once the sandbox exists, its audit
/// taken by [`JobEgress::finish`].
#[derive(Debug)]
pub struct JobEgress {
    job_id: String,
    slot: Arc<Mutex<Option<EgressProxy>>>,
    policy: Option<Policy>,
    node: Arc<NodeEgress>,
    limits: EgressLimits,
    /// Ports of the sandbox's own loopback listeners the proxy serves.
    loopback_ports: Vec<u16>,
}

impl JobEgress {
    pub fn new(node: Arc<NodeEgress>, job_id: &str, policy: Policy) -> JobEgress {
        JobEgress {
            job_id: job_id.into(),
            slot: Arc::new(Mutex::new(None)),
            policy: Some(policy),
            limits: node.limits.clone(),
            node,
            loopback_ports: Vec::new(),
        }
    }

    /// The proxy also serves the sandbox's own inference listener
    /// ([`crate::inference::listener::ADDR`]) to clients that send it requests for
    /// `127.0.0.1:11434` ([`crate::egress::SandboxLoopback`]).
    pub fn with_inference_listener(mut self) -> Self {
        self.loopback_ports = vec![crate::inference::listener::ADDR.port()];
        self
    }

    /// This proxy may carry at most `bytes` both ways (what is left of a session's
    /// budget), instead of the node's `max_total_bytes`.
    pub fn with_byte_budget(mut self, bytes: u64) -> Self {
        self.limits.max_total_bytes = self.limits.max_total_bytes.min(bytes);
        self
    }

    /// The backend's hook: binds [`PROXY_ADDR`] in the network namespace of the pid it is
    /// given (on a blocking thread: [`crate::egress::netns::bind_in_netns`] joins the namespace on a
    /// thread of its own) and starts the proxy there. Call once.
    pub fn hook(&mut self) -> NetnsHook {
        let slot = Arc::clone(&self.slot);
        let policy = self.policy.take();
        let node = Arc::clone(&self.node);
        let job_id = self.job_id.clone();
        let limits = self.limits.clone();
        let ports = self.loopback_ports.clone();
        Box::new(move |pid: u32| {
            Box::pin(async move {
                let policy = policy.ok_or("the egress hook ran twice")?;
                let (listener, netns) = tokio::task::spawn_blocking(move || {
                    let netns = Netns::of_pid(pid)?;
                    netns.bind(PROXY_ADDR).map(|l| (l, netns))
                })
                .await
                .map_err(|e| format!("egress proxy: the binding thread failed: {e}"))?
                .map_err(|e| {
                    format!("egress proxy: cannot listen inside the sandbox's network: {e}")
                })?;
                let loopback = (!ports.is_empty()).then(|| SandboxLoopback { netns, ports });
                let proxy = EgressProxy::start(
                    listener,
                    &job_id,
                    policy,
                    node.resolver.clone(),
                    Arc::clone(&node.routes),
                    limits,
                    loopback,
                )
                .map_err(|e| format!("egress proxy: cannot start: {e}"))?;
                match slot.lock() {
                    Ok(mut g) => *g = Some(proxy),
                    Err(p) => *p.into_inner() = Some(proxy),
                }
                Ok(())
            })
        })
    }

    /// The running proxy's audit and bytes carried so far; `None` before it started.
    pub fn snapshot(&self) -> Option<(EgressAudit, u64)> {
        let g = match self.slot.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        g.as_ref().map(|p| (p.audit(), p.bytes_used()))
    }

    /// The running proxy's connections still being served; `None` before it started.
    pub fn open_connections(&self) -> Option<usize> {
        let g = match self.slot.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        g.as_ref().map(|p| p.open_connections())
    }

    /// Ends the proxy (its open connections are cut) and returns its audit; `None` when
    /// it never started (the sandbox did not).
    pub async fn finish(self) -> Option<EgressAudit> {
        self.finish_counted().await.map(|(audit, _)| audit)
    }

    /// [`JobEgress::finish`], with the bytes the proxy carried both ways.
    pub async fn finish_counted(self) -> Option<(EgressAudit, u64)> {
        let proxy = match self.slot.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        }?;
        let bytes = proxy.bytes_used();
        let audit = proxy.finish().await;
        let denied = audit
            .records
            .iter()
            .filter(|r| r.decision == cynode_protocol::egress::EgressDecision::Denied)
            .count();
        tracing::info!(
            target: "cynode_worker::egress",
            job_id = %self.job_id,
            attempts = audit.records.len() as u64 + audit.dropped,
            denied,
            dropped = audit.dropped,
            "egress proxy closed"
        );
        Some((audit, bytes))
    }
}
