//! `cynode-pm policy check JOB.json`: the policy gate's decision on a job, as the PM
//! would take it (exit 0 allowed, 1 denied).

use std::path::PathBuf;

use clap::Subcommand;
use cynode_pm::bootstrap::{gate, load_registry, tenant};
use cynode_pm::policy::{Decision, Mode, PolicyInput};
use serde_json::{json, Value};

use super::args::{policy_source, skill_sources};
use super::{block_on, find_skill, print_json, read_json, Global, Output};

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

pub fn policy(cmd: &PolicyCmd, g: &Global) -> anyhow::Result<i32> {
    match cmd {
        PolicyCmd::Check {
            job,
            skill,
            dry_run,
        } => {
            let job = read_json(job)?;
            cynode_protocol::JobSpec::from_json(&serde_json::to_vec(&job)?)
                .map_err(|e| anyhow::anyhow!("invalid job.json: {e}"))?;
            let skill_id = skill
                .clone()
                .or_else(|| job["skill_id"].as_str().map(str::to_string));
            let manifest = match skill_id {
                Some(id) => {
                    let reg = load_registry(&skill_sources(g))?;
                    let s = find_skill(&reg, &id)?;
                    serde_json::to_value(&s.manifest)?
                }
                None => json!({}),
            };
            let mode = if *dry_run {
                Mode::DryRun
            } else {
                Mode::Enforce
            };
            let gate = gate(&policy_source(g), mode)?;
            let input = PolicyInput {
                job,
                skill: manifest,
                tenant: tenant(g.tenant.as_deref())?,
            };
            let decision = block_on(gate.evaluate(&input))?;
            print_decision(g.output, &decision);
            Ok(if decision.allowed { 0 } else { 1 })
        }
    }
}

fn print_decision(output: Output, d: &Decision) {
    match output {
        Output::Json => print_json(&serde_json::to_value(d).unwrap_or(Value::Null)),
        Output::Human => {
            outln!("{}", if d.allowed { "allowed" } else { "denied" });
            for v in &d.deny {
                outln!("  deny  {}: {}", v.rule, v.message);
            }
            for v in &d.warn {
                outln!("  warn  {}: {}", v.rule, v.message);
            }
        }
    }
}
