//! Command line and environment of `cynode-sba`: every flag also reads an `SBA_*` variable.

use std::path::PathBuf;

use clap::Parser;

use crate::runner::{self, Options};

/// Deterministic job runner for CyNode sandboxes.
#[derive(Debug, Parser)]
#[command(name = "cynode-sba", version, about)]
pub struct Cli {
    /// The job to run.
    #[arg(long, env = "SBA_JOB_PATH", default_value = "/job/job.json")]
    pub job: PathBuf,
    /// Where result.json is written (atomically).
    #[arg(long, env = "SBA_RESULT_PATH", default_value = "/job/result.json")]
    pub result: PathBuf,
    /// Directory collected as artifacts; commands see it as CYNODE_ARTIFACTS_DIR.
    #[arg(long, env = "SBA_ARTIFACTS_DIR", default_value = "/job/artifacts")]
    pub artifacts: PathBuf,
    /// The workspace root every path is confined to.
    #[arg(long, env = "SBA_WORKSPACE", default_value = "/workspace")]
    pub workspace: PathBuf,
    /// Read the job on stdin, print the result on stdout, log on stderr.
    #[arg(long = "stdin", env = "SBA_STDIN_STDOUT")]
    pub stdin_mode: bool,
    /// Allow running as uid 0 (refused by default).
    #[arg(long)]
    pub allow_root: bool,
    /// Agent mode: where the todo list is persisted (default: todo.json beside the result
    /// file; none in stdin mode).
    #[arg(long, env = "SBA_TODO_PATH")]
    pub todo: Option<PathBuf>,
    /// Agent mode: most model calls per job.
    #[arg(long, env = "SBA_AGENT_MAX_TURNS", default_value_t = crate::agent::DEFAULT_MAX_TURNS)]
    pub max_turns: u32,
    /// Agent mode: the model to use (must be in inference.allowed_models); default: the
    /// first allowed model the endpoint serves.
    #[arg(long, env = "SBA_INFERENCE_MODEL")]
    pub model: Option<String>,
    /// Agent mode: the node's tool gateway (`http+unix://` or `http://`), called for the
    /// tools the job lists in `context.mcp_tools`.
    #[arg(long, env = "SBA_GATEWAY_URL", default_value = crate::agent::tools::DEFAULT_GATEWAY_URL)]
    pub gateway: String,
}

/// Parses the command line, sets up logging, runs the job; returns the exit code.
pub fn main() -> i32 {
    if let Err(e) = crate::process::make_non_dumpable() {
        eprintln!("cynode-sba: cannot make the runner non-dumpable: {e}");
        return 1;
    }
    let cli = Cli::parse();
    init_logging(cli.stdin_mode);
    let status_url = std::env::var("SBA_JOB_STATUS_URL")
        .or_else(|_| std::env::var("SBA_CALLBACK_URL"))
        .ok()
        .filter(|s| !s.is_empty());
    let todo_path = cli.todo.or_else(|| {
        (!cli.stdin_mode).then(|| {
            cli.result
                .parent()
                .unwrap_or(std::path::Path::new("."))
                .join("todo.json")
        })
    });
    let agent = crate::agent::Settings {
        todo_path,
        max_turns: cli.max_turns.max(1),
        // Upstream CyNodeAI names the model INFERENCE_MODEL; ours wins when both are set.
        model: cli
            .model
            .or_else(|| std::env::var("INFERENCE_MODEL").ok())
            .filter(|m| !m.is_empty()),
        gateway_url: cli.gateway,
    };
    let opts = Options {
        agent,
        job: cli.job,
        result: cli.result,
        artifacts: cli.artifacts,
        workspace: cli.workspace,
        stdin_mode: cli.stdin_mode,
        allow_root: cli.allow_root,
        status_url,
    };
    runner::run(&opts)
}

/// JSON lines: on stdout in file mode, on stderr in stdin mode (stdout carries the result).
fn init_logging(stdin_mode: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SBA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_current_span(false)
        .with_target(false);
    if stdin_mode {
        builder.with_writer(std::io::stderr).init();
    } else {
        builder.with_writer(std::io::stdout).init();
    }
}
