//! `cynode-pm`'s command line: clap types, one module a command, and the exit codes.
//!
//! - [`skills`]: `skills list | show ID | validate [DIR…] | contract | render ID --inputs FILE`;
//! - [`jobs`]: `skills run ID --inputs FILE --workspace DIR` and `jobs run JOB.json
//!   --workspace DIR`, one job on a worker without the model loop;
//! - [`policy`]: `policy check JOB.json [--skill ID] [--dry-run]`;
//! - [`run`]: `run "objective"` and `sessions resume ID [--answer TEXT]`, with [`report`]
//!   printing their progress;
//! - [`sessions`]: `sessions list | show ID`;
//! - [`serve`]: `serve`, the HTTP API; `openapi` prints its description;
//! - [`mcp`]: `mcp`, the MCP server on stdio;
//! - [`args`]: the flag groups several commands share, turned into plain settings.
//!
//! `--help` groups a command's flags: its own under "Options" first, then the shared
//! groups of [`args`] ("Model", "Worker", "Local worker", "State", "Session"), then the
//! global flags ("Skills & policy", "Global options"), which every command takes.
//!
//! Human-readable output by default, `--output json` for scripts. Exit codes: 0 ok,
//! allowed, or a completed session; 1 invalid, denied, or a failed or canceled session;
//! 2 usage or load errors; 3 a session waiting for an answer no terminal can give.
//! `skills run` and `jobs run` tell their failures apart (see [`jobs`]): 1 the job failed,
//! 4 invalid inputs or job, 5 denied by the policy, 6 an artifact failed verification,
//! 7 no worker could take or run the job.
//!
//! Everything a command prints to stdout goes through [`outln!`] ([`stdout::line`]): a
//! reader that went away (`cynode-pm … | head`) ends the command quietly with status 0,
//! as a complete run would, without a panic or a message. SIGPIPE itself stays ignored
//! (Rust's default) since the same binary serves HTTP, where a closed socket is an error
//! of that one connection.
//!
//! Architecture invariant: this is the binary's only layer. It parses flags into
//! [`cynode_pm::config`] values and calls the library (bootstrap, driver, service);
//! nothing in the library imports from it, and only here is an error an `anyhow::Error`.

/// `println!` for command output: a closed stdout ends the command quietly (see
/// [`stdout::line`]).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cli::stdout::line(format_args!($($arg)*))
    };
}

mod args;
mod jobs;
mod mcp;
mod policy;
mod report;
mod run;
mod serve;
mod sessions;
mod skills;
mod stdout;

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};

/// The CyNode project-manager control plane.
#[derive(Debug, Parser)]
#[command(name = "cynode-pm", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes: the skills and the policy they are checked against,
/// then the output (its own heading, last in every command's `--help`).
#[derive(Debug, Args)]
pub struct Global {
    /// A directory of skill packages (repeatable): its skills are added to the built-in
    /// ones, and replace a built-in skill with the same id.
    #[arg(long = "skill-dir", global = true, help_heading = SKILLS_HEADING)]
    pub skill_dirs: Vec<PathBuf>,
    /// Offer only the skills of --skill-dir, none of the built-in ones.
    #[arg(long, global = true, requires = "skill_dirs", help_heading = SKILLS_HEADING)]
    pub no_builtin_skills: bool,
    /// Directory of the Rego policy (default: the built-in policy, policies/cynode.rego).
    #[arg(long, global = true, help_heading = SKILLS_HEADING)]
    pub policy_dir: Option<PathBuf>,
    /// An external OPA-compatible policy engine to ask instead (fails closed).
    #[arg(long, global = true, help_heading = SKILLS_HEADING)]
    pub policy_endpoint: Option<String>,
    /// Tenant policy settings (YAML or JSON); default: no network, default ceilings.
    #[arg(long, global = true, help_heading = SKILLS_HEADING)]
    pub tenant: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Output::Human, global = true,
          help_heading = GLOBAL_HEADING)]
    pub output: Output,
    /// Export traces over OTLP/HTTP (protobuf) to this collector, e.g.
    /// http://127.0.0.1:4318 or https://collector:4318 (`/v1/traces` is appended; https
    /// trusts the system's roots, or the bundle in SSL_CERT_FILE); Worker API calls then
    /// carry a W3C `traceparent` header.
    #[arg(long, env = "CYNODE_OTLP_ENDPOINT", global = true, help_heading = GLOBAL_HEADING)]
    pub otlp_endpoint: Option<String>,
}

/// `--help` heading of the global skill and policy flags.
pub const SKILLS_HEADING: &str = "Skills & policy";
/// `--help` heading of the other global flags (output, traces).
pub const GLOBAL_HEADING: &str = "Global options";

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Human,
    Json,
}

/// What to do.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Work with skill packages.
    #[command(subcommand)]
    Skills(skills::SkillsCmd),
    /// Work with the policy gate.
    #[command(subcommand)]
    Policy(policy::PolicyCmd),
    /// Run single jobs without the model loop.
    #[command(subcommand)]
    Jobs(Box<jobs::JobsCmd>),
    /// Run one objective end to end.
    Run(Box<run::RunCmd>),
    /// Work with stored sessions.
    #[command(subcommand)]
    Sessions(sessions::SessionsCmd),
    /// Serve the HTTP API for orchestrators (sessions, events, metrics).
    Serve(Box<serve::ServeArgs>),
    /// Serve MCP on stdin/stdout (sessions, skills, artifacts as tools) for one tenant.
    Mcp(Box<mcp::McpArgs>),
    /// Print the OpenAPI document of the HTTP API.
    Openapi,
}

/// Entry point; returns the exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    let output = cli.global.output;
    match dispatch(cli) {
        Ok(code) => code,
        Err(e) => {
            match output {
                Output::Human => eprintln!("cynode-pm: {e:#}"),
                Output::Json => outln!("{}", json!({ "ok": false, "error": format!("{e:#}") })),
            }
            2
        }
    }
}

fn dispatch(cli: Cli) -> anyhow::Result<i32> {
    let g = &cli.global;
    match &cli.command {
        Command::Run(cmd) => with_runtime(g, "warn", run::run(cmd, g)),
        Command::Sessions(cmd) => with_runtime(g, "warn", sessions::sessions(cmd, g)),
        // The service logs at info: its lines are its audit trail.
        Command::Serve(args) => with_runtime(g, "info", serve::serve(args, g)),
        Command::Mcp(args) => with_runtime(g, "info", mcp::mcp(args, g)),
        Command::Openapi => {
            outln!("{}", cynode_pm::service::openapi_json());
            Ok(0)
        }
        Command::Skills(skills::SkillsCmd::Run(cmd)) => {
            with_runtime(g, "warn", jobs::skill_run(cmd, g))
        }
        Command::Jobs(cmd) => with_runtime(g, "warn", jobs::jobs(cmd, g)),
        Command::Skills(cmd) => skills::skills(cmd, g),
        Command::Policy(cmd) => policy::policy(cmd, g),
    }
}

/// Runs `f` on a multi-threaded runtime with JSON log lines on stderr at
/// `CYNODE_LOG_LEVEL`, else `level`, and OTLP traces when `--otlp-endpoint` /
/// `CYNODE_OTLP_ENDPOINT` is set. The runtime is dropped before telemetry is shut down,
/// so the last spans are flushed.
fn with_runtime(
    g: &Global,
    level: &str,
    f: impl std::future::Future<Output = anyhow::Result<i32>>,
) -> anyhow::Result<i32> {
    let telemetry = cynode_pm::telemetry::init(level, g.otlp_endpoint.as_deref())?;
    let r = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
        .and_then(|rt| rt.block_on(f));
    telemetry.shutdown();
    r
}

/// Runs `f` to its end on a runtime of the calling thread (the commands that are not
/// services: policy checks).
fn block_on<F: std::future::Future>(f: F) -> anyhow::Result<F::Output> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    Ok(rt.block_on(f))
}

fn report_error(output: Output, msg: &str) {
    match output {
        Output::Human => eprintln!("error: {msg}"),
        Output::Json => print_json(&json!({ "ok": false, "error": msg })),
    }
}

fn read_json(p: &Path) -> anyhow::Result<Value> {
    let text = if p == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).context("cannot read stdin")?
    } else {
        std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?
    };
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", p.display()))
}

fn print_json(v: &Value) {
    outln!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

/// The skill `id` of `reg`, or an error naming it.
fn find_skill<'a>(
    reg: &'a cynode_pm::skills::Registry,
    id: &str,
) -> anyhow::Result<&'a cynode_pm::skills::Skill> {
    reg.get(id).with_context(|| format!("unknown skill `{id}`"))
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}
