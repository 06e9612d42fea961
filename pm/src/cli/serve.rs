//! `cynode-pm serve`: the HTTP API for orchestrator backends, on the workers of a workers
//! file or one `--worker-endpoint` (never a local worker: `serve` has no local-worker
//! flags).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use cynode_pm::app::auth::Tokens;
use cynode_pm::bootstrap;
use cynode_pm::service::ServeConfig;

use super::args::PmArgs;
use super::Global;

/// Flags of `cynode-pm serve` (plus the model, worker and state flags of `run`).
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "CYNODE_PM_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// `TOKEN TENANT` per line: who may call the API, and as which tenant.
    #[arg(long, env = "CYNODE_PM_API_TOKENS_FILE")]
    pub api_tokens_file: PathBuf,
    /// Lease of a session on this replica; another replica takes over a session whose
    /// lease expired (a replica died) within this time.
    #[arg(long, default_value_t = 30)]
    pub lease_seconds: u64,
    /// Sessions this replica drives at once.
    #[arg(long, default_value_t = 64)]
    pub max_active_sessions: usize,
    /// Largest request body accepted (413 above).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Largest request the sandbox gateway (`/v1/gateway`) accepts: an 8 MiB
    /// `artifact.put`, base64, and its envelope.
    #[arg(long, default_value_t = 12 << 20)]
    pub gateway_max_body_bytes: usize,
    /// Requests (other than event streams) taking longer are answered 408.
    #[arg(long, default_value_t = 30)]
    pub request_timeout_seconds: u64,
    /// On SIGTERM, how long sessions may take to finish their current step (a model call,
    /// a job's result) before their leases are released anyway.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace_seconds: u64,
    /// This replica's name in leases (default: host name and process id).
    #[arg(long, env = "CYNODE_PM_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// PEM certificate (chain): serve HTTPS instead of plain HTTP. Reloaded when the file
    /// changes or on SIGHUP.
    #[arg(long, env = "CYNODE_PM_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `--tls-cert-file`.
    #[arg(long, env = "CYNODE_PM_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// PEM CA: every client must then present a certificate issued by it (mutual TLS).
    #[arg(long, env = "CYNODE_PM_TLS_CLIENT_CA_FILE", requires = "tls_cert_file")]
    pub tls_client_ca_file: Option<PathBuf>,
    /// Connections held at once. When full, a new connection displaces the one idle (or
    /// mid-head) the longest; when every one has a request in flight it is refused (503).
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// A request head must arrive within this time.
    #[arg(long, default_value_t = 10)]
    pub header_read_timeout_seconds: u64,
    /// A connection with no request in flight for this long is closed.
    #[arg(long, default_value_t = 60)]
    pub idle_timeout_seconds: u64,
    /// Largest request head (431 above).
    #[arg(long, default_value_t = 64 * 1024)]
    pub max_header_bytes: usize,
    /// A TLS handshake must finish within this time.
    #[arg(long, default_value_t = 10)]
    pub tls_handshake_timeout_seconds: u64,
    /// The sandbox gateway's URL as the workers reach it (this service's `/v1/gateway`),
    /// handed to them with each job's token. Default: the listen address, when it is a
    /// loopback one; otherwise jobs get no gateway unless this is set.
    #[arg(long, env = "CYNODE_PM_GATEWAY_URL")]
    pub gateway_url: Option<String>,
    /// The sandbox gateway's egress settings (YAML or JSON, `egress:` at the top): the
    /// credentialed routes of `api.call` (`routes.<name>: {upstream, headers: {H: {env:
    /// VAR}}, ca_file?}`, values read from this process's environment at start), and
    /// for `web.fetch` `nameservers`, `ca_file`, `max_body_bytes`, `timeout_seconds`;
    /// `web.search`'s route `search: {base_url, max_results?, max_response_bytes?}`.
    #[arg(long, env = "CYNODE_PM_GATEWAY_EGRESS_FILE")]
    pub gateway_egress_file: Option<PathBuf>,
    #[command(flatten)]
    pub pm: PmArgs,
}

impl ServeArgs {
    /// The HTTPS settings, when `--tls-cert-file` and `--tls-key-file` are given.
    fn server_tls(&self) -> Option<cynode_tls::ServerTls> {
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => Some(cynode_tls::ServerTls {
                cert_file: cert.clone(),
                key_file: key.clone(),
                client_ca_file: self.tls_client_ca_file.clone(),
            }),
            _ => None,
        }
    }
}

/// Runs the service until SIGTERM / SIGINT (see [`cynode_pm::service::serve`]).
pub async fn serve(args: &ServeArgs, g: &Global) -> anyhow::Result<i32> {
    let tokens = Tokens::load(&args.api_tokens_file)?;
    let workers = args.pm.workers.config()?.context(
        "serve needs --workers-file (CYNODE_WORKERS_FILE) or --worker-endpoint (CYNODE_WORKER_ENDPOINT)",
    )?;
    let workers = bootstrap::workers(&workers)?;
    let config = args.pm.config(g);
    install_gateway_egress(args.gateway_egress_file.as_deref())?;
    let mut pm = bootstrap::build_pm(&config, workers).await?;
    // Bound first: the gateway's default URL names the bound port (`--listen …:0` too).
    let listener = std::net::TcpListener::bind(args.listen)
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let bound = listener.local_addr().context("the bound address")?;
    pm.gateway_url = args
        .gateway_url
        .clone()
        .or_else(|| default_gateway_url(bound, args.tls_cert_file.is_some()));
    let cfg = ServeConfig {
        listen: args.listen,
        tokens,
        lease: Duration::from_secs(args.lease_seconds),
        max_active_sessions: args.max_active_sessions,
        max_body_bytes: args.max_body_bytes,
        gateway_max_body_bytes: args.gateway_max_body_bytes,
        request_timeout: Duration::from_secs(args.request_timeout_seconds),
        shutdown_grace: Duration::from_secs(args.shutdown_grace_seconds),
        replica_id: args.replica_id.clone(),
        tls: args.server_tls(),
        listener: cynode_tls::ListenerLimits {
            max_connections: args.max_connections,
            header_read_timeout_seconds: args.header_read_timeout_seconds,
            idle_timeout_seconds: args.idle_timeout_seconds,
            max_header_bytes: args.max_header_bytes,
            tls_handshake_timeout_seconds: args.tls_handshake_timeout_seconds,
        },
    };
    cynode_pm::service::serve_on(pm, cfg, listener).await?;
    Ok(0)
}

/// The gateway's URL as workers reach it when `--gateway-url` is not given: the bound
/// address's `/v1/gateway`, when it is a loopback one (a worker elsewhere could not
/// reach it; jobs then get no gateway).
fn default_gateway_url(bound: SocketAddr, tls: bool) -> Option<String> {
    let scheme = if tls { "https" } else { "http" };
    bound
        .ip()
        .is_loopback()
        .then(|| format!("{scheme}://{bound}/v1/gateway"))
}

/// Sets up the gateway's `web.fetch` and `api.call` from `file` (or the defaults: the
/// system's resolver and roots, no routes); a route whose secret is missing from the
/// environment is an error now rather than a call sent without its credential.
pub(crate) fn install_gateway_egress(file: Option<&std::path::Path>) -> anyhow::Result<()> {
    use cynode_pm::mcp::egress;
    let settings = match file {
        Some(f) => egress::load(f)?,
        None => egress::Settings::default(),
    };
    egress::install(&settings).context("the gateway's egress settings")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    /// The default gateway URL names the bound port, so `--listen 127.0.0.1:0` offers
    /// one; a non-loopback address offers none.
    #[test]
    fn the_default_gateway_url_is_the_bound_loopback_address() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let bound = l.local_addr().unwrap();
        assert_ne!(bound.port(), 0);
        assert_eq!(
            super::default_gateway_url(bound, false),
            Some(format!("http://127.0.0.1:{}/v1/gateway", bound.port()))
        );
        assert_eq!(
            super::default_gateway_url("[::1]:8443".parse().unwrap(), true).as_deref(),
            Some("https://[::1]:8443/v1/gateway")
        );
        assert_eq!(
            super::default_gateway_url("0.0.0.0:8080".parse().unwrap(), false),
            None
        );
    }

    /// `serve` never starts a local worker, so it has no local-worker flags to ignore.
    #[test]
    fn serve_refuses_the_local_worker_flags() {
        for flag in [["--local-backend", "bwrap"], ["--local-bwrap-rootfs", "/r"]] {
            let mut argv = vec!["cynode-pm", "serve", "--api-tokens-file", "/t"];
            argv.extend(flag);
            let err = crate::cli::Cli::try_parse_from(argv).unwrap_err();
            assert_eq!(err.kind(), clap::error::ErrorKind::UnknownArgument, "{err}");
        }
        let ok = ["cynode-pm", "serve", "--api-tokens-file", "/t"];
        assert!(crate::cli::Cli::try_parse_from(ok).is_ok());
    }

    /// `sessions list` reads the datastore only: a model flag there is a mistake.
    #[test]
    fn sessions_list_takes_only_the_state_flags() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["cynode-pm", "sessions", "list"];
            argv.extend(extra);
            crate::cli::Cli::try_parse_from(argv)
        };
        assert!(parse(&["--state-dir", "/s"]).is_ok());
        assert!(parse(&["--model-base-url", "http://m"]).is_err());
    }

    /// The `serve` command lines of the deployments (Kubernetes, Compose, systemd) parse
    /// with these flags: a flag removed here would otherwise fail only in production.
    #[test]
    fn the_deployments_serve_command_lines_parse() {
        let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let read = |rel: &str| std::fs::read_to_string(repo.join(rel)).unwrap();
        let yaml_args = |rel: &str, pointer: &str| -> Vec<String> {
            let docs: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(&read(rel))
                .map(|d| serde::Deserialize::deserialize(d).unwrap())
                .collect();
            let args = docs.iter().find_map(|d| d.pointer(pointer)).unwrap();
            serde_json::from_value(args.clone()).unwrap()
        };
        let systemd: Vec<String> = read("deploy/systemd/cynode-pm.service")
            .split("ExecStart=")
            .nth(1)
            .unwrap()
            .replace("\\\n", " ")
            .lines()
            .next()
            .unwrap()
            .split_whitespace()
            .skip(1)
            .map(str::to_string)
            .collect();
        for (name, args) in [
            ("systemd", systemd),
            (
                "k8s",
                yaml_args(
                    "deploy/k8s/pm.yaml",
                    "/spec/template/spec/containers/0/args",
                ),
            ),
            (
                "compose",
                yaml_args("deploy/compose/compose.yaml", "/x-pm/command"),
            ),
        ] {
            assert_eq!(args.first().map(String::as_str), Some("serve"), "{name}");
            let argv = std::iter::once("cynode-pm".to_string()).chain(args.clone());
            if let Err(e) = crate::cli::Cli::try_parse_from(argv) {
                panic!("{name}: {args:?}: {e}");
            }
        }
    }
}
