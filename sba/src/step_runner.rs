//! Runs one step through the shared step code and records it. Direct steps (the runner)
//! and the agent's actions both come through here, so neither imports the other and both
//! get the same confinement, allowlists, output caps, deadlines and record.

use std::time::Instant;

use cynode_protocol::job::StepAction;
use cynode_protocol::result::{ErrorInfo, StepRecord};

use crate::steps::{self, StepContext};

/// Runs one step and logs it; the record is what result.json reports for it.
pub fn run_step(ctx: &StepContext<'_>, id: &str, action: &StepAction) -> StepRecord {
    let step_type = action.step_type();
    let t = Instant::now();
    let outcome = steps::execute(ctx, action);
    let status = outcome.status();
    let duration_ms = t.elapsed().as_millis() as u64;
    tracing::info!(
        job_id = %ctx.job.job_id,
        step_id = %id,
        step_type = step_type.as_str(),
        status = ?status,
        duration_ms,
        error = outcome.error.as_ref().map(|e| e.message.as_str()),
        "step finished"
    );
    StepRecord {
        id: id.to_string(),
        step_type,
        status,
        duration_ms,
        result: outcome.output,
        error: outcome.error.map(|e| ErrorInfo {
            kind: e.code,
            message: e.message,
        }),
    }
}
