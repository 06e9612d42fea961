//! The six step types. Each takes the shared [`StepContext`] and its typed arguments and
//! returns an [`Outcome`]: a structured result, an error with its failure code, or both
//! (a command that ran and exited non-zero has output and an error).

use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use cynode_protocol::job::{JobSpec, StepAction};
use cynode_protocol::result::{StepOutput, StepStatus};
use cynode_protocol::FailureCode;

use crate::confine::Workspace;
use crate::error::{Result, StepError};

pub mod apply_diff;
pub mod list_tree;
pub mod read_file;
pub mod run_command;
pub mod search_files;
pub mod write_file;

/// Everything a step may use; steps get nothing else.
#[derive(Debug)]
pub struct StepContext<'a> {
    pub ws: &'a Workspace,
    pub job: &'a JobSpec,
    /// The whole-job deadline.
    pub deadline: Instant,
    /// `max_runtime_seconds`, for messages.
    pub runtime_seconds: u64,
    /// Environment every command starts from (PATH, HOME, LANG, CYNODE_*).
    pub base_env: &'a [(String, String)],
    /// Where `CYNODE_ARTIFACTS_DIR` points.
    pub artifacts_dir: PathBuf,
    /// Readable when the runner has been asked to stop (SIGTERM).
    pub interrupt: Option<BorrowedFd<'a>>,
    pub interrupted: &'a AtomicBool,
}

impl StepContext<'_> {
    /// `max_output_bytes` as a usize.
    pub fn output_cap(&self) -> usize {
        usize::try_from(self.job.constraints.max_output_bytes).unwrap_or(usize::MAX)
    }

    /// Normalises a step path and applies `allowed_paths`.
    pub fn path(&self, input: &str) -> Result<PathBuf> {
        let rel = self.ws.relative(input)?;
        self.ws
            .check_allowed(&rel, self.job.constraints.allowed_paths.as_deref())?;
        Ok(rel)
    }

    /// Fails when the job deadline passed or the runner was interrupted (for long walks).
    pub fn check_time(&self) -> Result<()> {
        if self.interrupted.load(Ordering::Relaxed) {
            return Err(StepError::internal("runner interrupted by SIGTERM"));
        }
        if Instant::now() >= self.deadline {
            return Err(self.deadline_error());
        }
        Ok(())
    }

    /// The error for a job that ran out of time.
    pub fn deadline_error(&self) -> StepError {
        StepError::new(
            FailureCode::Timeout,
            format!(
                "job deadline of {}s (constraints.max_runtime_seconds) reached",
                self.runtime_seconds
            ),
        )
    }
}

/// What a step produced.
#[derive(Debug)]
pub struct Outcome {
    pub output: Option<StepOutput>,
    pub error: Option<StepError>,
}

impl Outcome {
    /// The step status this outcome implies.
    pub fn status(&self) -> StepStatus {
        match &self.error {
            None => StepStatus::Success,
            Some(e) if e.code == FailureCode::Timeout => StepStatus::Timeout,
            Some(_) => StepStatus::Failure,
        }
    }
}

impl From<Result<StepOutput>> for Outcome {
    fn from(r: Result<StepOutput>) -> Self {
        match r {
            Ok(output) => Outcome {
                output: Some(output),
                error: None,
            },
            Err(error) => Outcome {
                output: None,
                error: Some(error),
            },
        }
    }
}

/// Runs one step.
pub fn execute(ctx: &StepContext<'_>, action: &StepAction) -> Outcome {
    if let Err(e) = ctx.check_time() {
        return Err(e).into();
    }
    match action {
        StepAction::RunCommand(a) => run_command::run(ctx, a),
        StepAction::WriteFile(a) => write_file::run(ctx, a).into(),
        StepAction::ReadFile(a) => read_file::run(ctx, a).into(),
        StepAction::ApplyUnifiedDiff(a) => apply_diff::run(ctx, a).into(),
        StepAction::ListTree(a) => list_tree::run(ctx, a).into(),
        StepAction::SearchFiles(a) => search_files::run(ctx, a).into(),
    }
}
