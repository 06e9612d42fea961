//! Progress of `run` and `sessions resume` on stderr: lines that stay, and a spinner for
//! what is under way on a terminal.

use std::io::IsTerminal;
use std::time::Duration;

use cynode_pm::driver::Progress;

/// Prints progress to stderr: the chain of what happens (each reply, the plan, each job
/// with its sandbox, its result and verified artifacts) as lines that stay, and what is
/// under way (asking the model, a job's state) on a spinner line on a terminal.
pub struct Reporter {
    bar: Option<indicatif::ProgressBar>,
}

impl Reporter {
    pub fn new(json: bool) -> Self {
        let bar = (!json && std::io::stderr().is_terminal()).then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            b.enable_steady_tick(Duration::from_millis(120));
            b
        });
        Reporter { bar }
    }

    /// A line that stays.
    pub fn line(&self, msg: String) {
        match &self.bar {
            Some(b) => b.println(msg),
            None => eprintln!("{msg}"),
        }
    }

    /// What is under way: the spinner's message on a terminal, a line otherwise.
    pub fn status(&self, msg: String) {
        match &self.bar {
            Some(b) => b.set_message(msg),
            None => eprintln!("{msg}"),
        }
    }

    pub fn report(&self, p: Progress) {
        match p {
            Progress::Turn(t) => self.status(format!("turn {t}: asking the model")),
            Progress::Reply { kind, detail } => self.line(format!("model: {kind}: {detail}")),
            Progress::Plan(plan) => {
                self.line("plan:".to_string());
                for e in plan {
                    self.line(format!(
                        "  {} [{:?}] {}",
                        e.task_id, e.status, e.description
                    ));
                }
            }
            Progress::Dispatched {
                job_id,
                task_id,
                skill_id,
                worker_id,
                image,
                context,
                model,
            } => {
                self.line(format!(
                    "job {job_id}: skill {skill_id} for task {task_id}, on worker {worker_id} in \
                     sandbox {image}"
                ));
                if let Some(c) = context {
                    self.line(format!("  context: {c}"));
                }
                if let Some(m) = model {
                    self.line(format!("  model: {m}"));
                }
            }
            Progress::JobState { job_id, state } => self.status(format!("job {job_id}: {state:?}")),
            Progress::JobDone {
                job_id,
                status,
                failure,
                artifacts,
            } => {
                let why = failure.map(|f| format!(" ({f})")).unwrap_or_default();
                self.line(format!("job {job_id}: {status}{why}"));
                for a in artifacts {
                    self.line(format!(
                        "  artifact {} sha256:{} ({} bytes, verified)",
                        a.path, a.sha256, a.size_bytes
                    ));
                }
            }
            Progress::PolicyDenied { task_id, reasons } => {
                self.line(format!("policy denied {task_id}: {}", reasons.join("; ")))
            }
            Progress::Question(q) => self.line(format!("question: {q}")),
            Progress::Finished(s) => self.line(format!("session {}", s.as_str())),
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
