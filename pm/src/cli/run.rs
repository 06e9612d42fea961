//! `cynode-pm run "objective"` and `sessions resume`: one session end to end, on a
//! configured worker or a local one started for it, with live progress and questions
//! answered at the terminal.

use std::io::{BufRead, IsTerminal};
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use cynode_pm::bootstrap;
use cynode_pm::dispatch::WorkerClient;
use cynode_pm::local_worker::{LocalWorker, Notice};
use cynode_pm::session::{Phase, SessionRecord, SessionStatus};
use cynode_pm::workers::WorkerPool;
use tracing::Instrument;

use super::args::RunArgs;
use super::report::Reporter;
use super::{Global, Output};

/// Exit code when the session waits for an answer and no terminal can give it.
pub const EXIT_AWAITING_INPUT: i32 = 3;

/// `run "objective"`.
#[derive(Debug, Args)]
pub struct RunCmd {
    /// What to achieve.
    pub objective: String,
    /// A directory the session's workspace is seeded from.
    #[arg(long)]
    pub workspace: Option<PathBuf>,
    /// Nobody answers questions: the model is never offered `message`, so it must
    /// plan, act or finish (the default when stdin is not a terminal).
    #[arg(long, conflicts_with = "interactive")]
    pub non_interactive: bool,
    /// Offer the model `message` even when stdin is not a terminal: its question
    /// then parks the session (exit 3) for `sessions resume --answer`.
    #[arg(long)]
    pub interactive: bool,
    #[command(flatten)]
    pub args: RunArgs,
}

/// `run`: a new session, autonomous unless a person is at the terminal (or
/// `--interactive`).
pub async fn run(cmd: &RunCmd, g: &Global) -> anyhow::Result<i32> {
    let interactive = cmd.interactive || (!cmd.non_interactive && std::io::stdin().is_terminal());
    let start = Start::New {
        objective: &cmd.objective,
        workspace: cmd.workspace.as_deref(),
        interactive,
    };
    run_session(&cmd.args, g, start).await
}

/// What [`run_session`] starts from.
#[derive(Debug, Clone, Copy)]
pub enum Start<'a> {
    /// A new session for `objective`, its workspace seeded from `workspace`.
    /// `interactive`: a person answers the model's questions at this terminal (else the
    /// model is never offered `message`, see `llm::turn`).
    New {
        objective: &'a str,
        workspace: Option<&'a Path>,
        interactive: bool,
    },
    /// A stored session, given `answer` first when it waits for one.
    Resume {
        id: &'a str,
        answer: Option<&'a str>,
    },
}

/// Runs (or resumes) a session to its end; returns the exit code. Everything it does is
/// inside one `session` span (one trace when traces are exported).
pub async fn run_session(args: &RunArgs, global: &Global, start: Start<'_>) -> anyhow::Result<i32> {
    let session_id = match start {
        Start::Resume { id, .. } => id.to_string(),
        Start::New { .. } => format!("s-{}", uuid::Uuid::new_v4()),
    };
    let span = tracing::info_span!("session", session_id = %session_id);
    drive_session(args, global, start, &session_id)
        .instrument(span)
        .await
}

async fn drive_session(
    args: &RunArgs,
    global: &Global,
    start: Start<'_>,
    session_id: &str,
) -> anyhow::Result<i32> {
    std::fs::create_dir_all(&args.pm.store.state_dir)?;
    let seed = match start {
        Start::New {
            workspace: Some(w), ..
        } => Some(std::fs::canonicalize(w).context("--workspace")?),
        _ => None,
    };
    let json_out = global.output == Output::Json;
    let reporter = Reporter::new(json_out);
    // Declared before the local worker: dropped after it.
    let relay = inference_relay(&args.pm)?;
    let (workers, _local) = worker_pool(
        &args.pm.workers,
        || args.local_worker(global, seed.clone(), relay.as_ref()),
        relay.as_ref(),
        &|line| reporter.line(line),
    )?;
    let config = args.pm.config(global);
    super::serve::install_gateway_egress(args.gateway_egress_file.as_deref())?;
    let mut pm = bootstrap::build_pm(&config, workers).await?;
    pm.tenant
        .egress
        .allow
        .extend(args.egress_allow.iter().cloned());
    // The sandbox gateway for this session's jobs (those listing tools), as `serve`
    // hosts it: on its own listener, its URL handed to the workers with each job's token.
    let listener = if gateway_hosted(args)? {
        let listener = std::net::TcpListener::bind(args.gateway_listen)
            .with_context(|| format!("--gateway-listen {}", args.gateway_listen))?;
        let addr = listener.local_addr()?;
        if let Some(tls) = gateway_tls(args) {
            // A bad certificate or key is an error now, not a gateway that never answers.
            cynode_tls::server_config(&tls).context("--gateway-tls-cert/--gateway-tls-key")?;
        }
        // gateway_hosted: without --gateway-url the listen address is a loopback one.
        let scheme = if gateway_tls(args).is_some() {
            "https"
        } else {
            "http"
        };
        pm.gateway_url = Some(
            args.gateway_url
                .clone()
                .unwrap_or_else(|| format!("{scheme}://{addr}/v1/gateway")),
        );
        Some(listener)
    } else {
        None
    };
    let pm = std::sync::Arc::new(pm);
    let _gateway = listener.map(|l| {
        cynode_pm::mcp::gateway::host(
            std::sync::Arc::clone(&pm),
            l,
            args.gateway_max_body_bytes,
            gateway_tls(args),
        )
    });
    match start {
        Start::Resume { id, answer } => {
            if let Some(text) = answer {
                pm.answer(id, text).await?;
            }
        }
        Start::New {
            objective,
            interactive,
            ..
        } => {
            let mut rec =
                SessionRecord::new(session_id, &args.tenant_id, objective, args.budgets());
            rec.interactive = interactive;
            // The workspace is created, seeded from here, on the worker its first job
            // is placed on.
            rec.workspace_seed = seed.as_ref().map(|p| p.display().to_string());
            pm.create(&rec).await?;
        }
    }
    reporter.line(format!("session {session_id}"));
    reporter.line(model_line(&config.model));
    let interactive = std::io::stdin().is_terminal();
    let rec = loop {
        let rec = pm.run(session_id, &mut |p| reporter.report(p)).await?;
        if rec.status == SessionStatus::AwaitingInput && interactive {
            let Phase::AwaitInput { question } = &rec.phase else {
                break rec;
            };
            reporter.finish();
            eprint!("{question}\n> ");
            let mut answer = String::new();
            std::io::stdin().lock().read_line(&mut answer)?;
            pm.answer(session_id, answer.trim()).await?;
            continue;
        }
        break rec;
    };
    reporter.finish();
    Ok(print_outcome(&rec, json_out))
}

/// The progress line naming the loop's model and its endpoint (without any userinfo the
/// URL may hold; the key is never shown).
fn model_line(m: &cynode_pm::llm::client::ModelConfig) -> String {
    let endpoint = match url::Url::parse(&m.base_url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.to_string()
        }
        Err(_) => m.base_url.clone(),
    };
    let key = if m.api_key.is_some() {
        ", with a key"
    } else {
        ""
    };
    format!("model {} at {endpoint}{key}", m.model)
}

/// The workers `workers` names (`--worker-endpoint`, `--workers-file`), else a local
/// worker started from `local()`'s settings, returned with the pool: it runs while that
/// handle lives. `say` gets one line per notice of the local worker (waiting for another
/// PM's worker, attaching to a running one).
pub(crate) fn worker_pool(
    workers: &super::args::WorkerArgs,
    local: impl FnOnce() -> anyhow::Result<cynode_pm::config::LocalWorkerConfig>,
    relay: Option<&cynode_pm::inference_relay::Relay>,
    say: &dyn Fn(String),
) -> anyhow::Result<(WorkerPool, Option<LocalWorker>)> {
    if let Some(cfg) = workers.config()? {
        return Ok((bootstrap::workers(&cfg)?, None));
    }
    let cfg = local()?;
    let worker = LocalWorker::start(&cfg, &|n| match n {
        Notice::Waiting { holder_pid, dir } => say(format!(
            "another cynode-pm's worker (pid {holder_pid}) uses {}; waiting for it to finish",
            dir.display()
        )),
        Notice::Attached { keeper_pid, dir } => say(format!(
            "using the local worker already running on {} (keeper pid {keeper_pid})",
            dir.display()
        )),
    })?;
    // A worker that outlived its PM calls that PM's relay: serve it there too, or its
    // agent jobs could reach no model (the address stays its PM's until it restarts).
    if let (Some(relay), Some(url)) = (relay, worker.previous_relay.clone()) {
        match relay.also_serve(&url) {
            Ok(()) => say(format!(
                "serving the inference relay the local worker calls at {url}"
            )),
            Err(e) => say(format!(
                "cannot serve the inference relay the local worker calls at {url} ({e}); its agent jobs cannot reach the model"
            )),
        }
    }
    let pool = WorkerPool::single(
        WorkerClient::new(&worker.endpoint, &worker.token),
        &workers.sandbox_image,
    );
    Ok((pool, Some(worker)))
}

/// The inference relay of a run on a local worker whose model takes a key
/// (`CYNODE_MODEL_API_KEY`): on a fresh loopback port, forwarding to the model with the
/// key added here, so the local worker's agent jobs reach the model without the key
/// leaving this process. None when the model takes no key or the workers are configured
/// (`--worker-endpoint`, `--workers-file`: their own upstream serves their agent jobs).
pub(crate) fn inference_relay(
    pm: &super::args::PmArgs,
) -> anyhow::Result<Option<cynode_pm::inference_relay::Relay>> {
    use cynode_pm::inference_relay::{self, RelaySettings};
    if pm.workers.config()?.is_some() {
        return Ok(None);
    }
    let Some(key) = cynode_pm::llm::ModelConfig::api_key_from_env() else {
        return Ok(None);
    };
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
        .context("cannot listen for the inference relay on 127.0.0.1")?;
    let relay = inference_relay::start(
        listener,
        RelaySettings {
            base_url: pm.model.model_base_url.clone(),
            api_key: key.into(),
            ca_file: pm.model.ca_file.clone(),
            max_request_bytes: inference_relay::MAX_REQUEST_BYTES,
            max_response_bytes: inference_relay::MAX_RESPONSE_BYTES,
            timeout: std::time::Duration::from_secs(pm.model.model_timeout_seconds),
        },
    )
    .context("the inference relay")?;
    Ok(Some(relay))
}

/// Whether `run` hosts the sandbox gateway; an error for flags that would expose it:
/// - `--no-gateway`: no;
/// - `--gateway-url` must be `http://` or `https://`;
/// - a non-loopback `--gateway-listen` without `--gateway-url`: no (warned), the workers
///   could not be told where it is; with one, refused unless the gateway speaks HTTPS
///   (`--gateway-tls-cert`) or `--gateway-allow-plain-http` is given (tokens would
///   cross the network in clear);
/// - with `--gateway-tls-cert`, an `http://` `--gateway-url` is refused;
/// - a remote worker (`--worker-endpoint` not on loopback, or `--workers-file`) and no
///   `--gateway-url`: no (warned), a loopback URL would not reach it.
pub(crate) fn gateway_hosted(args: &RunArgs) -> anyhow::Result<bool> {
    if args.no_gateway {
        return Ok(false);
    }
    if let Some(url) = &args.gateway_url {
        let ok = ["http://", "https://"]
            .iter()
            .any(|p| url.len() > p.len() && url.starts_with(p));
        if !ok {
            anyhow::bail!("--gateway-url {url}: must be an http:// or https:// URL");
        }
        if gateway_tls(args).is_some() && !url.starts_with("https://") {
            anyhow::bail!("--gateway-url {url}: the gateway speaks HTTPS (--gateway-tls-cert)");
        }
    }
    let listen = args.gateway_listen;
    if !listen.ip().is_loopback() {
        if args.gateway_url.is_none() {
            tracing::warn!(%listen, "the gateway would listen on a non-loopback address without --gateway-url: no gateway, jobs get no token");
            return Ok(false);
        }
        if !args.gateway_allow_plain_http && gateway_tls(args).is_none() {
            anyhow::bail!(
                "--gateway-listen {listen} is not a loopback address and the gateway speaks plain HTTP (job tokens in clear); listen on loopback (behind a TLS proxy named by --gateway-url), or give --gateway-allow-plain-http on a trusted network"
            );
        }
    }
    if args.gateway_url.is_none() && remote_worker(args) {
        tracing::warn!("the worker is not on this machine and no --gateway-url names a gateway it can reach: no gateway, jobs get no token");
        return Ok(false);
    }
    Ok(true)
}

/// The hosted gateway's HTTPS settings, when `--gateway-tls-cert` and `--gateway-tls-key`
/// are given (no client certificates: the workers present job tokens).
fn gateway_tls(args: &RunArgs) -> Option<cynode_tls::ServerTls> {
    match (&args.gateway_tls_cert, &args.gateway_tls_key) {
        (Some(cert), Some(key)) => Some(cynode_tls::ServerTls {
            cert_file: cert.clone(),
            key_file: key.clone(),
            client_ca_file: None,
        }),
        _ => None,
    }
}

/// Whether the session's worker may be on another machine: `--workers-file`, or a
/// `--worker-endpoint` whose host is not a loopback address or `localhost`.
fn remote_worker(args: &RunArgs) -> bool {
    let w = &args.pm.workers;
    if w.workers_file.is_some() {
        return true;
    }
    let Some(endpoint) = &w.worker_endpoint else {
        return false;
    };
    let host = endpoint
        .split_once("://")
        .map_or(endpoint.as_str(), |(_, rest)| rest)
        .split(['/', '?', '#'])
        .next()
        .unwrap_or_default();
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    !loopback
}

/// Prints the deliverable or the failure; returns the exit code.
fn print_outcome(rec: &SessionRecord, json_out: bool) -> i32 {
    if json_out {
        outln!("{}", serde_json::to_string_pretty(rec).unwrap_or_default());
    }
    match rec.status {
        SessionStatus::Completed => {
            if !json_out {
                if let Some(d) = &rec.deliverable {
                    let report = rec.report();
                    outln!("deliverable (evidence verified by the PM):");
                    outln!("{}", report.evidence_text().trim_end());
                    if let Some(c) = &d.changeset {
                        outln!("changeset:\n{}", c.trim_end());
                    }
                    outln!("{}", report.summary_line());
                }
            }
            0
        }
        SessionStatus::AwaitingInput => {
            if !json_out {
                if let Phase::AwaitInput { question } = &rec.phase {
                    outln!("awaiting input: {question}");
                    outln!(
                        "answer with: cynode-pm sessions resume {} --answer TEXT",
                        rec.state.session_id
                    );
                }
            }
            EXIT_AWAITING_INPUT
        }
        _ => {
            if !json_out {
                let f = rec.failure.as_ref();
                eprintln!(
                    "session {} {}: {}",
                    rec.state.session_id,
                    f.map(|f| f.kind.as_str()).unwrap_or("failed"),
                    f.map(|f| f.message.as_str()).unwrap_or("")
                );
            }
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    fn run_args(extra: &[&str]) -> super::RunArgs {
        let mut argv = vec!["cynode-pm", "run", "o"];
        argv.extend_from_slice(extra);
        match crate::cli::Cli::try_parse_from(argv).unwrap().command {
            crate::cli::Command::Run(cmd) => cmd.args,
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_tls_gateway_may_listen_beyond_loopback() {
        let hosted = |extra: &[&str]| super::gateway_hosted(&run_args(extra));
        let tls = ["--gateway-tls-cert", "c.pem", "--gateway-tls-key", "k.pem"];
        let url = ["--gateway-url", "https://pm.example:8443/v1/gateway"];
        let listen = ["--gateway-listen", "0.0.0.0:0"];
        assert!(hosted(&[&listen[..], &url[..], &tls[..]].concat()).unwrap());
        // Without TLS the same flags are refused (plain HTTP beyond loopback).
        assert!(hosted(&[&listen[..], &url[..]].concat()).is_err());
        // An http:// URL for an HTTPS gateway is refused.
        let plain = ["--gateway-url", "http://pm.example/v1/gateway"];
        let e = hosted(&[&listen[..], &plain[..], &tls[..]].concat())
            .unwrap_err()
            .to_string();
        assert!(e.contains("HTTPS"), "{e}");
        // The certificate needs its key.
        let mut argv = vec!["cynode-pm", "run", "o", "--gateway-tls-cert", "c.pem"];
        assert!(crate::cli::Cli::try_parse_from(argv.drain(..)).is_err());
        assert_eq!(
            super::gateway_tls(&run_args(&tls)).map(|t| t.cert_file),
            Some(std::path::PathBuf::from("c.pem"))
        );
    }

    #[test]
    fn the_gateway_is_hosted_only_where_it_is_safe_and_reachable() {
        let hosted = |extra: &[&str]| super::gateway_hosted(&run_args(extra));
        // A local worker, loopback: hosted.
        assert!(hosted(&[]).unwrap());
        assert!(hosted(&["--worker-endpoint", "http://127.0.0.1:9"]).unwrap());
        assert!(hosted(&["--worker-endpoint", "https://localhost:9/x"]).unwrap());
        assert!(!hosted(&["--no-gateway"]).unwrap());
        // A remote worker without a URL: no gateway (a loopback URL would not reach it).
        assert!(!hosted(&["--worker-endpoint", "https://10.1.2.3:9"]).unwrap());
        assert!(!hosted(&["--worker-endpoint", "http://node.example:9"]).unwrap());
        let url = ["--gateway-url", "https://pm.example/v1/gateway"];
        assert!(
            hosted(&[&["--worker-endpoint", "https://10.1.2.3:9"][..], &url[..]].concat()).unwrap()
        );
        // The URL's scheme.
        for bad in [
            "ftp://x/v1/gateway",
            "pm.example:1",
            "http://",
            "javascript:x",
        ] {
            let e = hosted(&["--gateway-url", bad]).unwrap_err().to_string();
            assert!(e.contains("--gateway-url"), "{e}");
        }
        // A non-loopback listen: no gateway without a URL; refused without the plain
        // HTTP opt-in; accepted with it.
        assert!(!hosted(&["--gateway-listen", "0.0.0.0:0"]).unwrap());
        let e = hosted(&[&["--gateway-listen", "0.0.0.0:0"][..], &url[..]].concat())
            .unwrap_err()
            .to_string();
        assert!(e.contains("--gateway-allow-plain-http"), "{e}");
        assert!(hosted(
            &[
                &[
                    "--gateway-listen",
                    "0.0.0.0:0",
                    "--gateway-allow-plain-http"
                ][..],
                &url[..]
            ]
            .concat()
        )
        .unwrap());
    }

    #[test]
    fn an_empty_sandbox_image_is_refused_at_the_command_line() {
        let parse = |image: &str| {
            crate::cli::Cli::try_parse_from(["cynode-pm", "run", "o", "--sandbox-image", image])
        };
        let err = parse("").unwrap_err().to_string();
        assert!(err.contains("--sandbox-image"), "{err}");
        assert!(parse("localhost/x:1").is_ok());
    }
}
