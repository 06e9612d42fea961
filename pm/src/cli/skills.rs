//! `cynode-pm skills …`: list, show, validate, contract and render skill packages, and
//! run one (`skills run`, in [`super::jobs`]).

use std::path::PathBuf;

use clap::Subcommand;
use cynode_pm::bootstrap::{gate, load_registry, registry, tenant};
use cynode_pm::policy::{Mode, PolicyGate, PolicyInput, TenantPolicy};
use cynode_pm::skills::{build_job, JobRef, Registry, Skill, SkillError};
use serde_json::json;

use super::args::{policy_source, skill_sources};
use super::{
    block_on, find_skill, first_line, print_json, read_json, report_error, Global, Output,
};

/// `skills …`
#[derive(Debug, Subcommand)]
pub enum SkillsCmd {
    /// List the registered skills.
    List,
    /// Show one skill: manifest, input schema, examples.
    Show { id: String },
    /// Check packages: manifest, schema, template (every variable it uses declared in the
    /// input schema), and that every example validates, renders, and passes the protocol
    /// and the policy. With `--tenant FILE` the skill is checked against that tenant (its
    /// ceilings, network, purposes); without, as if its tenant allowed all it declares.
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
    /// Render a skill with inputs, check it against the policy, run it on a worker (the
    /// local one by default), wait, verify every artifact's sha256 and print the result.
    /// The local worker reaches the model at --model-base-url (through a relay that keeps
    /// CYNODE_MODEL_API_KEY in this process when it is set), so agent skills run on it.
    Run(Box<super::jobs::SkillRunCmd>),
}

pub fn skills(cmd: &SkillsCmd, g: &Global) -> anyhow::Result<i32> {
    match cmd {
        SkillsCmd::List => {
            let reg = load_registry(&skill_sources(g))?;
            match g.output {
                Output::Human => {
                    for s in reg.iter() {
                        let m = &s.manifest;
                        outln!(
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
        SkillsCmd::Show { id } => {
            let reg = load_registry(&skill_sources(g))?;
            let s = find_skill(&reg, id)?;
            let v = json!({
                "manifest": s.manifest,
                "dir": s.dir,
                "examples": s.examples.iter().map(|(n, v)| json!({ "file": n, "inputs": v })).collect::<Vec<_>>(),
            });
            match g.output {
                Output::Human => outln!("{}", serde_yaml::to_string(&v)?),
                Output::Json => print_json(&v),
            }
            Ok(0)
        }
        SkillsCmd::Contract => {
            let contract =
                cynode_pm::llm::Contract::new(load_registry(&skill_sources(g))?.catalog())?;
            let schema = cynode_pm::llm::TurnRules::first_turn(true).schema(&contract.catalog, &[]);
            match g.output {
                Output::Human => outln!(
                    "{}\n# Response schema (first turn)\n{}",
                    contract.system_prompt,
                    cynode_pm::llm::ordered_json(&schema, true)
                ),
                Output::Json => print_json(&json!({
                    "system_prompt": contract.system_prompt,
                    "response_schema": schema,
                })),
            }
            Ok(0)
        }
        SkillsCmd::Validate { dirs } => {
            let loaded = if dirs.is_empty() {
                registry(&skill_sources(g))
            } else {
                Registry::load(dirs)
            };
            validate(g, loaded)
        }
        SkillsCmd::Render {
            id,
            inputs,
            session,
            task,
            attempt,
        } => {
            let reg = load_registry(&skill_sources(g))?;
            let s = find_skill(&reg, id)?;
            let inputs = read_json(inputs)?;
            let r = JobRef {
                session_id: session.clone(),
                task_id: task.clone(),
                attempt: *attempt,
            };
            match build_job(s, &inputs, &r) {
                Ok(built) => {
                    outln!("{}", String::from_utf8_lossy(&built.canonical));
                    Ok(0)
                }
                Err(e) => {
                    report_error(g.output, &e.to_string());
                    Ok(1)
                }
            }
        }
        // Dispatched on a runtime by `cli::dispatch`.
        SkillsCmd::Run(_) => {
            anyhow::bail!("skills run needs the async runtime of cli::dispatch")
        }
    }
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
        let gate = gate(&policy_source(g), Mode::Enforce)?;
        let tenant = match &g.tenant {
            Some(path) => Some(tenant(Some(path))?),
            None => None,
        };
        for s in reg.iter() {
            let before = errors.len();
            if let Some(t) = &tenant {
                check_against_tenant(s, t, &mut errors);
            }
            check_examples(s, &gate, tenant.as_ref(), &mut errors)?;
            if errors.len() == before {
                ok.push(json!({ "skill_id": s.manifest.skill_id, "version": s.manifest.version, "examples": s.examples.len() }));
            }
        }
    }
    match g.output {
        Output::Human => {
            for s in &ok {
                outln!(
                    "ok    {} {} ({} examples)",
                    s["skill_id"].as_str().unwrap_or(""),
                    s["version"].as_str().unwrap_or(""),
                    s["examples"]
                );
            }
            for e in &errors {
                outln!("{e}");
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

/// The manifest against a tenant's settings: what no job of the skill could get past.
fn check_against_tenant(s: &Skill, t: &TenantPolicy, errors: &mut Vec<SkillError>) {
    let m = &s.manifest;
    let file = s.dir.join(cynode_pm::skills::registry::MANIFEST_FILE);
    let mut refuse = |message: String| {
        errors.push(SkillError {
            file: file.clone(),
            line: None,
            message: format!("tenant `{}`: {message}", t.tenant_id),
        })
    };
    if m.limits.max_runtime_seconds > t.max_runtime_seconds {
        refuse(format!(
            "limits.max_runtime_seconds {} exceeds the tenant's max_runtime_seconds {}",
            m.limits.max_runtime_seconds, t.max_runtime_seconds
        ));
    }
    if m.limits.max_output_bytes > t.max_output_bytes {
        refuse(format!(
            "limits.max_output_bytes {} exceeds the tenant's max_output_bytes {}",
            m.limits.max_output_bytes, t.max_output_bytes
        ));
    }
    // A skill that declares its egress uses the network only when its inputs ask
    // (fetching dependencies); without a tenant allowing it, its jobs run offline.
    if m.network && m.egress.is_empty() && !t.allow_network && t.egress.allow.is_empty() {
        refuse("the skill declares network, which the tenant does not allow".into());
    }
    if !t.allowed_purposes.is_empty() && !t.allowed_purposes.contains(&m.purpose) {
        refuse(format!(
            "purpose `{}` is not in the tenant's allowed_purposes",
            m.purpose
        ));
    }
}

fn check_examples(
    s: &Skill,
    gate: &PolicyGate,
    tenant: Option<&TenantPolicy>,
    errors: &mut Vec<SkillError>,
) -> anyhow::Result<()> {
    // Without a tenant, as if the tenant allowed everything the skill declares.
    let tenant = tenant.cloned().unwrap_or_else(|| TenantPolicy {
        allow_network: s.manifest.network,
        ..TenantPolicy::default()
    });
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
