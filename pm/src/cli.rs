//! `cynode-pm`: the skill author's and operator's command line.
//!
//! `skills list | show ID | validate [DIR…] | render ID --inputs FILE` and
//! `policy check JOB.json [--skill ID]`. Human-readable output by default, `--output json`
//! for scripts. Exit codes: 0 ok / allowed, 1 invalid / denied, 2 usage or load errors.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};

use crate::policy::{Decision, Mode, PolicyGate, PolicyInput, TenantPolicy};
use crate::skills::{build_job, JobRef, Registry, Skill, SkillError};

/// The CyNode project-manager control plane.
#[derive(Debug, Parser)]
#[command(name = "cynode-pm", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Args)]
pub struct Global {
    /// Output format.
    #[arg(long, value_enum, default_value_t = Output::Human, global = true)]
    pub output: Output,
    /// A directory of skill packages (repeatable): its skills are added to the built-in
    /// ones, and replace a built-in skill with the same id.
    #[arg(long = "skill-dir", global = true)]
    pub skill_dirs: Vec<PathBuf>,
    /// Offer only the skills of --skill-dir, none of the built-in ones.
    #[arg(long, global = true, requires = "skill_dirs")]
    pub no_builtin_skills: bool,
    /// Directory of the Rego policy (default: the built-in policy, policies/cynode.rego).
    #[arg(long, global = true)]
    pub policy_dir: Option<PathBuf>,
    /// An external OPA-compatible policy engine to ask instead (fails closed).
    #[arg(long, global = true)]
    pub policy_endpoint: Option<String>,
    /// Tenant policy settings (YAML or JSON); default: no network, default ceilings.
    #[arg(long, global = true)]
    pub tenant: Option<PathBuf>,
    /// Export traces over OTLP/HTTP (protobuf) to this collector, e.g.
    /// http://127.0.0.1:4318 or https://collector:4318 (`/v1/traces` is appended; https
    /// trusts the system's roots, or the bundle in SSL_CERT_FILE); Worker API calls then
    /// carry a W3C `traceparent` header.
    #[arg(long, env = "CYNODE_OTLP_ENDPOINT", global = true)]
    pub otlp_endpoint: Option<String>,
}

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
    Skills(SkillsCmd),
    /// Work with the policy gate.
    #[command(subcommand)]
    Policy(PolicyCmd),
    /// Run one objective end to end.
    Run {
        /// What to achieve.
        objective: String,
        /// A directory the session's workspace is seeded from.
        #[arg(long)]
        workspace: Option<PathBuf>,
        /// Nobody answers questions: the model is never offered `message`, so it must
        /// plan, act or finish (the default when stdin is not a terminal).
        #[arg(long, conflicts_with = "interactive")]
        non_interactive: bool,
        /// Offer the model `message` even when stdin is not a terminal: its question
        /// then parks the session (exit 3) for `sessions resume --answer`.
        #[arg(long)]
        interactive: bool,
        #[command(flatten)]
        args: crate::run::RunArgs,
    },
    /// Work with stored sessions.
    #[command(subcommand)]
    Sessions(SessionsCmd),
    /// Serve the HTTP API for orchestrators (sessions, events, metrics).
    Serve(Box<crate::service::ServeArgs>),
    /// Print the OpenAPI document of the HTTP API.
    Openapi,
}

/// `sessions …`
#[derive(Debug, Subcommand)]
pub enum SessionsCmd {
    /// List sessions, newest first.
    List {
        #[arg(long)]
        status: Option<String>,
        #[command(flatten)]
        args: crate::run::RunArgs,
    },
    /// Show one session's state.
    Show {
        id: String,
        #[command(flatten)]
        args: crate::run::RunArgs,
    },
    /// Continue a session (after a crash, or with the answer to its question).
    Resume {
        id: String,
        #[arg(long)]
        answer: Option<String>,
        #[command(flatten)]
        args: crate::run::RunArgs,
    },
}

/// `skills …`
#[derive(Debug, Subcommand)]
pub enum SkillsCmd {
    /// List the registered skills.
    List,
    /// Show one skill: manifest, input schema, examples.
    Show { id: String },
    /// Check packages: manifest, schema, template, and that every example validates,
    /// renders, and passes the protocol and the policy.
    Validate { dirs: Vec<PathBuf> },
    /// Print what the model is sent for these skills: the system prompt and the response
    /// schema of a first turn (`--output json`: both in one object).
    Contract,
    /// Render a skill with inputs and print the job.json.
    Render {
        id: String,
        /// JSON file with the inputs (`-` for stdin).
        #[arg(long)]
        inputs: PathBuf,
        #[arg(long, default_value = "cli-session")]
        session: String,
        #[arg(long, default_value = "cli-task")]
        task: String,
        #[arg(long, default_value_t = 0)]
        attempt: u32,
    },
}

/// `policy …`
#[derive(Debug, Subcommand)]
pub enum PolicyCmd {
    /// Evaluate a job.json against the policy and print the decision.
    Check {
        job: PathBuf,
        /// The skill whose manifest the policy sees (default: the job's skill_id).
        #[arg(long)]
        skill: Option<String>,
        /// Audit only: report violations but allow.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Entry point; returns the exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    let output = cli.global.output;
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            match output {
                Output::Human => eprintln!("cynode-pm: {e:#}"),
                Output::Json => println!("{}", json!({ "ok": false, "error": format!("{e:#}") })),
            }
            2
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    let g = &cli.global;
    match &cli.command {
        Command::Run {
            objective,
            workspace,
            non_interactive,
            interactive,
            args,
        } => {
            let telemetry = init_logging(g, "warn")?;
            let interactive = *interactive || (!*non_interactive && std::io::stdin().is_terminal());
            let start = crate::run::Start::New {
                objective,
                workspace: workspace.as_deref(),
                interactive,
            };
            let r = runtime().and_then(|rt| rt.block_on(crate::run::run_session(args, g, start)));
            telemetry.shutdown();
            r
        }
        Command::Sessions(cmd) => {
            let telemetry = init_logging(g, "warn")?;
            let r = runtime().and_then(|rt| rt.block_on(sessions(cmd, g)));
            telemetry.shutdown();
            r
        }
        Command::Serve(args) => {
            // The service logs at info: its lines are its audit trail.
            let telemetry = init_logging(g, "info")?;
            let r = runtime().and_then(|rt| rt.block_on(crate::service::serve(args, g)));
            telemetry.shutdown();
            r
        }
        Command::Openapi => {
            println!("{}", crate::service::openapi_json());
            Ok(0)
        }
        Command::Skills(SkillsCmd::List) => {
            let reg = load_registry(g)?;
            match g.output {
                Output::Human => {
                    for s in reg.iter() {
                        let m = &s.manifest;
                        println!(
                            "{:<22} {:<8} {}",
                            m.skill_id,
                            m.version,
                            first_line(&m.description)
                        );
                    }
                }
                Output::Json => print_json(&json!(reg.catalog())),
            }
            Ok(0)
        }
        Command::Skills(SkillsCmd::Show { id }) => {
            let reg = load_registry(g)?;
            let s = reg
                .get(id)
                .with_context(|| format!("unknown skill `{id}`"))?;
            let v = json!({
                "manifest": s.manifest,
                "dir": s.dir,
                "examples": s.examples.iter().map(|(n, v)| json!({ "file": n, "inputs": v })).collect::<Vec<_>>(),
            });
            match g.output {
                Output::Human => println!("{}", serde_yaml::to_string(&v)?),
                Output::Json => print_json(&v),
            }
            Ok(0)
        }
        Command::Skills(SkillsCmd::Contract) => {
            let contract = crate::llm::Contract::new(load_registry(g)?.catalog())?;
            let schema = crate::llm::TurnRules::first_turn(true).schema(&contract.catalog, &[]);
            match g.output {
                Output::Human => println!(
                    "{}\n# Response schema (first turn)\n{}",
                    contract.system_prompt,
                    crate::llm::ordered_json(&schema, true)
                ),
                Output::Json => print_json(&json!({
                    "system_prompt": contract.system_prompt,
                    "response_schema": schema,
                })),
            }
            Ok(0)
        }
        Command::Skills(SkillsCmd::Validate { dirs }) => {
            let loaded = if dirs.is_empty() {
                registry(g)
            } else {
                Registry::load(dirs)
            };
            validate(g, loaded)
        }
        Command::Skills(SkillsCmd::Render {
            id,
            inputs,
            session,
            task,
            attempt,
        }) => {
            let reg = load_registry(g)?;
            let s = reg
                .get(id)
                .with_context(|| format!("unknown skill `{id}`"))?;
            let inputs = read_json(inputs)?;
            let r = JobRef {
                session_id: session.clone(),
                task_id: task.clone(),
                attempt: *attempt,
            };
            match build_job(s, &inputs, &r) {
                Ok(built) => {
                    println!("{}", String::from_utf8_lossy(&built.canonical));
                    Ok(0)
                }
                Err(e) => {
                    report_error(g.output, &e.to_string());
                    Ok(1)
                }
            }
        }
        Command::Policy(PolicyCmd::Check {
            job,
            skill,
            dry_run,
        }) => {
            let job = read_json(job)?;
            cynode_protocol::JobSpec::from_json(&serde_json::to_vec(&job)?)
                .map_err(|e| anyhow::anyhow!("invalid job.json: {e}"))?;
            let skill_id = skill
                .clone()
                .or_else(|| job["skill_id"].as_str().map(str::to_string));
            let manifest = match skill_id {
                Some(id) => {
                    let reg = load_registry(g)?;
                    let s = reg
                        .get(&id)
                        .with_context(|| format!("unknown skill `{id}`"))?;
                    serde_json::to_value(&s.manifest)?
                }
                None => json!({}),
            };
            let mode = if *dry_run {
                Mode::DryRun
            } else {
                Mode::Enforce
            };
            let gate = gate(g, mode)?;
            let input = PolicyInput {
                job,
                skill: manifest,
                tenant: tenant(g)?,
            };
            let decision = block_on(gate.evaluate(&input))?;
            print_decision(g.output, &decision);
            Ok(if decision.allowed { 0 } else { 1 })
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// JSON log lines on stderr at `CYNODE_LOG_LEVEL`, else `default`, and OTLP traces when
/// `--otlp-endpoint` / `CYNODE_OTLP_ENDPOINT` is set ([`crate::telemetry`]). The runtime
/// is dropped before the returned guard is shut down, so the last spans are flushed.
fn init_logging(g: &Global, default: &str) -> anyhow::Result<crate::telemetry::Telemetry> {
    crate::telemetry::init(default, g.otlp_endpoint.as_deref())
}

async fn sessions(cmd: &SessionsCmd, g: &Global) -> anyhow::Result<i32> {
    let args = match cmd {
        SessionsCmd::List { args, .. }
        | SessionsCmd::Show { args, .. }
        | SessionsCmd::Resume { args, .. } => args,
    };
    let url = match &args.datastore_endpoint {
        Some(u) => u.clone(),
        None => format!("sqlite://{}", args.state_dir.join("pm.db").display()),
    };
    match cmd {
        SessionsCmd::List { status, .. } => {
            let store = crate::store::Store::connect(&url).await?;
            let list = store.list(status.as_deref()).await?;
            match g.output {
                Output::Json => print_json(&serde_json::to_value(&list)?),
                Output::Human => {
                    for r in &list {
                        println!(
                            "{}  {:<15} {}",
                            r.state.session_id,
                            r.status.as_str(),
                            first_line(&r.state.objective)
                        );
                    }
                }
            }
            Ok(0)
        }
        SessionsCmd::Show { id, .. } => {
            let store = crate::store::Store::connect(&url).await?;
            let (rec, _) = store
                .load(id)
                .await?
                .with_context(|| format!("no session {id}"))?;
            match g.output {
                Output::Json => print_json(&serde_json::to_value(&rec)?),
                Output::Human => println!("{}", serde_yaml::to_string(&rec)?),
            }
            Ok(0)
        }
        SessionsCmd::Resume { id, answer, .. } => {
            let start = crate::run::Start::Resume {
                id,
                answer: answer.as_deref(),
            };
            crate::run::run_session(args, g, start).await
        }
    }
}

/// The skills of this invocation: the built-in ones with --skill-dir on top, or only
/// --skill-dir's with --no-builtin-skills.
fn registry(g: &Global) -> Result<Registry, Vec<SkillError>> {
    if g.no_builtin_skills {
        Registry::load(&g.skill_dirs)
    } else {
        Registry::builtin_with(&g.skill_dirs)
    }
}

/// [`registry`], every problem in one error.
pub(crate) fn load_registry(g: &Global) -> anyhow::Result<Registry> {
    registry(g).map_err(|errs| {
        anyhow::anyhow!(
            "cannot load skills:\n{}",
            errs.iter()
                .map(|e| format!("  {e}"))
                .collect::<Vec<_>>()
                .join("\n")
        )
    })
}

pub(crate) fn gate(g: &Global, mode: Mode) -> anyhow::Result<PolicyGate> {
    Ok(match &g.policy_endpoint {
        Some(url) => PolicyGate::remote(url, "cynode/policy", mode),
        None => match &g.policy_dir {
            Some(d) => PolicyGate::local_from_dir(d, mode)
                .map_err(|e| anyhow::anyhow!("cannot load policy from {}: {e}", d.display()))?,
            None => {
                PolicyGate::builtin(mode).map_err(|e| anyhow::anyhow!("built-in policy: {e}"))?
            }
        },
    })
}

pub(crate) fn tenant(g: &Global) -> anyhow::Result<TenantPolicy> {
    match &g.tenant {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            serde_yaml::from_str(&text)
                .with_context(|| format!("invalid tenant file {}", p.display()))
        }
        None => Ok(TenantPolicy::default()),
    }
}

fn block_on<F: std::future::Future>(f: F) -> anyhow::Result<F::Output> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    Ok(rt.block_on(f))
}

/// Validates packages: load errors, then per example: inputs, render, protocol, policy.
fn validate(g: &Global, loaded: Result<Registry, Vec<SkillError>>) -> anyhow::Result<i32> {
    let mut errors: Vec<SkillError> = Vec::new();
    let reg = match loaded {
        Ok(r) => r,
        Err(e) => {
            errors = e;
            Registry::default()
        }
    };
    let mut ok = Vec::new();
    if !reg.is_empty() {
        // The skill is checked as if its tenant allowed everything the skill declares.
        let gate = gate(g, Mode::Enforce)?;
        for s in reg.iter() {
            let before = errors.len();
            check_examples(s, &gate, &mut errors)?;
            if errors.len() == before {
                ok.push(json!({ "skill_id": s.manifest.skill_id, "version": s.manifest.version, "examples": s.examples.len() }));
            }
        }
    }
    match g.output {
        Output::Human => {
            for s in &ok {
                println!(
                    "ok    {} {} ({} examples)",
                    s["skill_id"].as_str().unwrap_or(""),
                    s["version"].as_str().unwrap_or(""),
                    s["examples"]
                );
            }
            for e in &errors {
                println!("{e}");
            }
        }
        Output::Json => print_json(&json!({
            "ok": errors.is_empty(),
            "skills": ok,
            "errors": errors.iter().map(|e| json!({ "file": e.file, "line": e.line, "message": e.message })).collect::<Vec<_>>(),
        })),
    }
    Ok(if errors.is_empty() { 0 } else { 1 })
}

fn check_examples(
    s: &Skill,
    gate: &PolicyGate,
    errors: &mut Vec<SkillError>,
) -> anyhow::Result<()> {
    let tenant = TenantPolicy {
        allow_network: s.manifest.network,
        ..TenantPolicy::default()
    };
    for (i, (name, inputs)) in s.examples.iter().enumerate() {
        let file = s.dir.join("examples").join(name);
        let r = JobRef {
            session_id: "validate".into(),
            task_id: format!("example-{i}"),
            attempt: 0,
        };
        let built = match build_job(s, inputs, &r) {
            Ok(b) => b,
            Err(e) => {
                errors.push(SkillError {
                    file,
                    line: None,
                    message: e.to_string(),
                });
                continue;
            }
        };
        let input = PolicyInput {
            job: built.value,
            skill: serde_json::to_value(&s.manifest)?,
            tenant: tenant.clone(),
        };
        let decision = block_on(gate.evaluate(&input))?;
        for v in &decision.deny {
            errors.push(SkillError {
                file: file.clone(),
                line: None,
                message: format!("policy denies ({}): {}", v.rule, v.message),
            });
        }
    }
    Ok(())
}

fn print_decision(output: Output, d: &Decision) {
    match output {
        Output::Json => print_json(&serde_json::to_value(d).unwrap_or(Value::Null)),
        Output::Human => {
            println!("{}", if d.allowed { "allowed" } else { "denied" });
            for v in &d.deny {
                println!("  deny  {}: {}", v.rule, v.message);
            }
            for v in &d.warn {
                println!("  warn  {}: {}", v.rule, v.message);
            }
        }
    }
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
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}
