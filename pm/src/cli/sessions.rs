//! `cynode-pm sessions list | show ID | resume ID [--answer TEXT]`: the stored sessions.

use anyhow::Context;
use clap::Subcommand;
use cynode_pm::config::datastore_url;
use cynode_pm::session::{egress, Phase};
use cynode_pm::store::Store;

use super::args::{RunArgs, StoreArgs};
use super::run::{run_session, Start};
use super::{first_line, print_json, Global, Output};

/// `sessions …`
#[derive(Debug, Subcommand)]
pub enum SessionsCmd {
    /// List sessions, newest first.
    List {
        #[arg(long)]
        status: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Show one session's state.
    Show {
        id: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Continue a session (after a crash, or with the answer to its question).
    Resume {
        id: String,
        #[arg(long)]
        answer: Option<String>,
        #[command(flatten)]
        args: Box<RunArgs>,
    },
}

/// The datastore of `store` (by URL, or SQLite in the state directory).
async fn connect(store: &StoreArgs) -> anyhow::Result<Store> {
    let url = datastore_url(store.datastore_endpoint.as_deref(), &store.state_dir);
    Ok(Store::connect(&url).await?)
}

pub async fn sessions(cmd: &SessionsCmd, g: &Global) -> anyhow::Result<i32> {
    match cmd {
        SessionsCmd::List { status, store } => {
            let store = connect(store).await?;
            let list = store.list(status.as_deref()).await?;
            match g.output {
                Output::Json => print_json(&serde_json::to_value(&list)?),
                Output::Human => {
                    for r in &list {
                        outln!(
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
        SessionsCmd::Show { id, store } => {
            let store = connect(store).await?;
            let (rec, _) = store
                .load(id)
                .await?
                .with_context(|| format!("no session {id}"))?;
            match g.output {
                Output::Json => {
                    let mut v = serde_json::to_value(&rec)?;
                    v["report"] = serde_json::to_value(rec.report())?;
                    // Every job's egress audit, as stored (also in state.history).
                    v["egress"] = serde_json::to_value(egress::of(&rec))?;
                    print_json(&v)
                }
                Output::Human => {
                    outln!("session {}: {}", rec.state.session_id, rec.status.as_str());
                    outln!("objective: {}", first_line(&rec.state.objective));
                    if let Some(f) = &rec.failure {
                        outln!("failure: {}: {}", f.kind.as_str(), f.message);
                    }
                    if let Phase::AwaitInput { question } = &rec.phase {
                        outln!("question: {question}");
                    }
                    let report = rec.report();
                    outln!("evidence verified by the PM:");
                    outln!("{}", report.evidence_text().trim_end());
                    if let Some(c) = rec.deliverable.as_ref().and_then(|d| d.changeset.as_ref()) {
                        outln!("changeset:\n{}", c.trim_end());
                    }
                    let jobs = egress::of(&rec);
                    if !jobs.is_empty() {
                        outln!("{}", egress::text(&jobs, egress::SHOWN_PER_JOB).trim_end());
                    }
                    outln!("{}", report.summary_line());
                }
            }
            Ok(0)
        }
        SessionsCmd::Resume { id, answer, args } => {
            let start = Start::Resume {
                id,
                answer: answer.as_deref(),
            };
            run_session(args, g, start).await
        }
    }
}
