//! Runs one step through the shared step code and records it. Direct steps (the runner)
//! and the agent's actions both come through here, so neither imports the other and both
//! get the same confinement, allowlists, output caps, deadlines and record.

use std::time::Instant;

use cynode_protocol::job::StepAction;
use cynode_protocol::result::StepRecord;

use crate::steps::{self, StepContext};

/// Runs one step and logs it; the record is what result.json reports for it (its
/// `index` is set when it is added to the result, [`cynode_protocol::JobResult::push_step`]).
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
    let mut rec = StepRecord::skipped(0, id, step_type);
    rec.status = status;
    rec.duration_ms = duration_ms;
    rec.set_result(outcome.output);
    if let Some(e) = outcome.error {
        rec.set_error(e.code, e.message);
    }
    rec
}
