//! `write_file`: atomic, confined, never replacing a file unless the job allows it.

use base64::Engine;
use cynode_protocol::job::{parse_mode, ContentEncoding, WriteFileArgs};
use cynode_protocol::result::{StepOutput, WriteFileOutput};

use super::StepContext;
use crate::confine::display;
use crate::error::{Result, StepError};

/// Runs the step.
pub fn run(ctx: &StepContext<'_>, args: &WriteFileArgs) -> Result<StepOutput> {
    let rel = ctx.path(&args.path)?;
    let bytes = match args.encoding.unwrap_or_default() {
        ContentEncoding::Utf8 => args.content.as_bytes().to_vec(),
        ContentEncoding::Base64 => base64::engine::general_purpose::STANDARD
            .decode(args.content.as_bytes())
            .map_err(|e| StepError::failed(format!("content is not valid base64: {e}")))?,
    };
    let mode = match &args.mode {
        Some(m) => parse_mode(m).map_err(StepError::failed)?,
        None => 0o644,
    };
    let written = ctx.ws.write_atomic(
        &rel,
        &mut bytes.as_slice(),
        mode,
        ctx.job.constraints.allow_overwrite,
    )?;
    Ok(StepOutput::WriteFile(WriteFileOutput {
        path: display(&rel),
        size_bytes: written.size_bytes,
        sha256: written.sha256,
        created: written.created,
    }))
}
