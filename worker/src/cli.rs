//! `cynode-worker serve | check`: flags override the config file; with no file at all the
//! flags give a working node with safe defaults.
//!
//! `serve` holds an exclusive `flock` on `<state_dir>/worker.lock` for its whole life,
//! taken before the start-up reconciliation: a second worker on the same state directory
//! logs `waiting for the state directory lock` and waits until the first one is gone, so
//! its reconciliation never removes the sandboxes of a live worker. The lock goes with the
//! process (even on SIGKILL), and its descriptor is close-on-exec, so no sandbox inherits
//! it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use cynode_worker::config::{BackendKind, Config};
use cynode_worker::node::Node;

/// The CyNode Worker API node.
#[derive(Debug, Parser)]
#[command(name = "cynode-worker", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// What to do.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the Worker API.
    Serve(NodeArgs),
    /// Run the startup checks and print what is missing.
    Check(NodeArgs),
    /// Re-run a retained job from its stored request and report whether the result matches.
    Replay {
        /// The job to replay.
        job_id: String,
        #[command(flatten)]
        node: NodeArgs,
    },
    /// Internal: started by `serve`, removes the node's sandboxes once the node is gone
    /// (`cynode_worker::janitor`).
    #[command(hide = true)]
    Janitor(NodeArgs),
}

/// Config file and the flags that override it.
#[derive(Debug, Args)]
pub struct NodeArgs {
    /// YAML configuration file.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Sandbox backend.
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// Directory for the job database, job directories and workspaces.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// File holding the bearer token (else WORKER_API_BEARER_TOKEN).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// bwrap: `IMAGE=ROOTFS_DIR`, the root filesystem used for an image (repeatable).
    #[arg(long = "bwrap-rootfs", value_parser = parse_rootfs)]
    pub bwrap_rootfs: Vec<(String, PathBuf)>,
}

fn parse_rootfs(s: &str) -> Result<(String, PathBuf), String> {
    let (image, dir) = s.split_once('=').ok_or("expected IMAGE=ROOTFS_DIR")?;
    Ok((image.to_string(), PathBuf::from(dir)))
}

impl NodeArgs {
    /// The effective configuration.
    pub fn config(&self) -> anyhow::Result<Config> {
        let mut cfg = match &self.config {
            Some(p) => Config::load(p)?,
            None => Config::default(),
        };
        if let Some(l) = self.listen {
            cfg.listen = l;
        }
        if let Some(b) = self.backend {
            cfg.backend = b;
        }
        if let Some(d) = &self.state_dir {
            cfg.state_dir = d.clone();
        }
        if let Some(t) = &self.token_file {
            cfg.token_file = Some(t.clone());
        }
        for (image, dir) in &self.bwrap_rootfs {
            cfg.bwrap.rootfs.insert(image.clone(), dir.clone());
        }
        Ok(cfg)
    }
}

/// Entry point; returns the process exit code.
pub fn main() -> anyhow::Result<i32> {
    let cli = Cli::parse();
    let exporter =
        cynode_worker::trace::init(std::env::var("CYNODE_OTLP_ENDPOINT").ok().as_deref())?;
    if let Command::Janitor(args) = &cli.command {
        cynode_worker::janitor::run(&args.config()?)?;
        return Ok(0);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let code = rt.block_on(async move {
        match cli.command {
            Command::Serve(args) => serve(args).await.map(|()| 0),
            Command::Check(args) => check(args).await,
            Command::Janitor(_) => unreachable!("the janitor runs without the runtime"),
            Command::Replay { job_id, node } => {
                let report = cynode_worker::replay::replay(&node.config()?, &job_id).await?;
                println!("{}", serde_json::to_string_pretty(&report)?);
                Ok(if report.matches { 0 } else { 1 })
            }
        }
    });
    drop(rt);
    // Outside the runtime: the exporter's blocking client sends what is still buffered.
    if let Some(p) = exporter {
        if let Err(e) = p.shutdown() {
            eprintln!("cynode-worker: exporting the last traces failed: {e}");
        }
    }
    code
}

async fn check(args: NodeArgs) -> anyhow::Result<i32> {
    let cfg = args.config()?;
    let mut missing = Vec::new();
    if let Err(e) = cfg.token() {
        missing.push(format!("token: {e}"));
    }
    let backend = cynode_worker::backend::from_config(&cfg);
    match backend.check().await {
        Ok(v) => println!("ok   backend {}: {v}", cfg.backend.as_str()),
        Err(e) => missing.push(format!("backend {}: {e}", cfg.backend.as_str())),
    }
    if cfg.inference.is_some() {
        match cynode_worker::inference::listener::refusal(&cfg) {
            None => println!("ok   inference: a listener at 127.0.0.1:11434 in each sandbox"),
            Some(why) => {
                println!("note inference: jobs and sessions with inference are refused: {why}")
            }
        }
    }
    let mut images = cfg.images.clone();
    if let Some(d) = cfg.default_image.as_ref().filter(|d| !images.contains(d)) {
        images.push(d.clone());
    }
    for image in &images {
        if backend.has_image(image).await {
            let label = cynode_worker::backend::image_labels::describe(&cfg, image).await;
            println!("ok   image {image}: {label}");
        } else {
            missing.push(format!("image {image}: not available locally"));
        }
    }
    if cfg.allow_unlabelled_agent_images {
        println!(
            "note images: allow_unlabelled_agent_images is on: agent jobs run on images without {}=true",
            cynode_worker::backend::image_labels::AGENT_COMPATIBLE
        );
    }
    if let Err(e) = std::fs::create_dir_all(&cfg.state_dir) {
        missing.push(format!("state dir {}: {e}", cfg.state_dir.display()));
    }
    // Kernel-enforced disk limits, or the poller as the fallback (not a failure).
    let (layout, shape, _) = cynode_worker::loopfs::plan(&cfg);
    match tokio::task::spawn_blocking(move || {
        cynode_worker::loopfs::probe(&layout.state_dir, shape)
    })
    .await?
    {
        Ok(()) => println!(
            "ok   disk limits: {}",
            cynode_worker::loopfs::Enforcement::Kernel
        ),
        Err(why) => println!(
            "note disk limits: {}",
            cynode_worker::loopfs::Enforcement::Poller(why)
        ),
    }
    for m in &missing {
        println!("MISSING {m}");
    }
    Ok(if missing.is_empty() { 0 } else { 1 })
}

/// Log message of a worker waiting for another one's state-directory lock (the PM
/// watches for it).
pub const LOCK_WAIT_MESSAGE: &str = "waiting for the state directory lock";

/// The exclusive lock on a worker's state directory, held while the value lives.
#[derive(Debug)]
pub struct StateLock {
    file: std::fs::File,
}

impl StateLock {
    /// Takes the lock on `<state_dir>/worker.lock`, waiting (with a log line naming the
    /// holder's pid) while another process holds it; then records this process's pid.
    pub async fn acquire(state_dir: &std::path::Path) -> anyhow::Result<StateLock> {
        use std::io::{Read, Seek, Write};
        use std::os::fd::AsRawFd;
        std::fs::create_dir_all(state_dir)
            .with_context(|| format!("cannot create {}", state_dir.display()))?;
        let path = state_dir.join("worker.lock");
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let flock = |fd: i32, op: i32| -> std::io::Result<()> {
            loop {
                // SAFETY: flock on a descriptor owned by `file`, alive for this call.
                if unsafe { libc::flock(fd, op) } == 0 {
                    return Ok(());
                }
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        };
        let fd = file.as_raw_fd();
        match flock(fd, libc::LOCK_EX | libc::LOCK_NB) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                tracing::warn!(lock = %path.display(), holder_pid = %holder.trim(), "{LOCK_WAIT_MESSAGE}");
                file = tokio::task::spawn_blocking(move || {
                    flock(file.as_raw_fd(), libc::LOCK_EX).map(|()| file)
                })
                .await
                .context("the lock waiter broke")?
                .with_context(|| format!("cannot lock {}", path.display()))?;
            }
            Err(e) => return Err(e).with_context(|| format!("cannot lock {}", path.display())),
        }
        file.set_len(0)?;
        file.rewind()?;
        write!(file, "{}", std::process::id())?;
        tracing::info!(lock = %path.display(), "holding the state directory lock");
        Ok(StateLock { file })
    }

    /// The lock's descriptor (the janitor inherits it, and the lock with it).
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.file)
    }
}

async fn serve(args: NodeArgs) -> anyhow::Result<()> {
    let cfg = args.config()?;
    let token = cfg.token()?;
    let listen = cfg.listen;
    let tls = cfg.tls.clone();
    let limits = cfg.listener.clone();
    if tls.is_none() && !listen.ip().is_loopback() && !cfg.allow_plain_http {
        anyhow::bail!(
            "refusing to serve the Worker API (and its bearer token) over plain http on the non-loopback address {listen}: configure tls.cert_file and tls.key_file, or set allow_plain_http: true when a TLS-terminating proxy on this host fronts it"
        );
    }
    if let Some(t) = &tls {
        // Fail at start-up, naming the file, rather than on the first connection.
        cynode_tls::server_config(t).context("tls")?;
    }
    // Before anything touches the state directory: reconciliation must never run while
    // another live worker owns it.
    let lock = StateLock::acquire(&cfg.state_dir).await?;
    // However this process ends, its sandboxes go with it.
    let serve_flags: Vec<std::ffi::OsString> = std::env::args_os().skip(2).collect();
    let janitor = cynode_worker::janitor::Janitor::spawn(&serve_flags, lock.fd())
    .map_err(|e| tracing::warn!(error = %e, "no janitor: a node killed during a sandbox's setup leaves that setup running until its restart"))
    .ok();
    let state_dir = cfg.state_dir.clone();
    let node = Node::start(cfg, token).await?;
    let listener = std::net::TcpListener::bind(listen)
        .with_context(|| format!("cannot listen on {listen}"))?;
    let ready = node.readiness();
    let scheme = if tls.is_some() { "https" } else { "http" };
    tracing::info!(addr = %listener.local_addr()?, scheme, mutual_tls = tls.as_ref().is_some_and(|t| t.client_ca_file.is_some()), backend = node.backend.kind().as_str(), ready = ready.ready, detail = %ready.detail, "cynode-worker listening");
    let app = cynode_worker::http::app(Arc::clone(&node));
    cynode_tls::serve_with(listener, app, tls, limits, shutdown_signal())
        .await
        .context("server failed")?;
    // Stop accepting is done; give running jobs a grace period, then stop them. Results
    // are recorded either way.
    let grace = tokio::time::Instant::now() + Duration::from_secs(30);
    while node.active() > 0 && tokio::time::Instant::now() < grace {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if node.active() > 0 {
        tracing::warn!(
            active = node.active(),
            "stopping jobs still running after the grace period"
        );
        node.cancel_all();
        while node.active() > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    cynode_worker::backend::shutdown(&state_dir);
    cynode_worker::loopfs::close_pool();
    // The janitor removes the sandboxes, then unmounts the node's volumes.
    if let Some(j) = janitor {
        if !tokio::task::spawn_blocking(move || j.finish())
            .await
            .unwrap_or(false)
        {
            tracing::warn!("the janitor did not finish its sweep within 70 s");
        }
    }
    // Volumes never outlive their node: whatever is still mounted beneath the state
    // directory (no janitor, or one that ran out of time) goes now. Their images keep
    // the content; the next start mounts them again.
    let released =
        tokio::task::spawn_blocking(move || cynode_worker::loopfs::release_node(&state_dir))
            .await
            .unwrap_or_default();
    tracing::info!(
        unmounted = released.unmounted,
        detached = released.detached,
        left_mounted = released.left,
        "cynode-worker stopped"
    );
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => {},
                _ = i.recv() => {},
            }
        }
        _ => std::future::pending::<()>().await,
    }
}
