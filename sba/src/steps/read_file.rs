//! `read_file`: confined read of at most `max_bytes` (default `max_output_bytes`); the
//! sha256 and size always describe the whole file.

use std::io::Read;

use base64::Engine;
use cynode_protocol::job::{ContentEncoding, ReadFileArgs};
use cynode_protocol::result::{ReadFileOutput, StepOutput};
use sha2::{Digest, Sha256};

use super::StepContext;
use crate::confine::display;
use crate::error::{Result, StepError};

/// Runs the step.
pub fn run(ctx: &StepContext<'_>, args: &ReadFileArgs) -> Result<StepOutput> {
    let rel = ctx.path(&args.path)?;
    let shown = display(&rel);
    let (mut file, _) = ctx.ws.open_read(&rel)?;
    let limit = args
        .max_bytes
        .unwrap_or(ctx.job.constraints.max_output_bytes)
        .min(ctx.job.constraints.max_output_bytes);
    let mut head = Vec::new();
    (&mut file)
        .take(limit)
        .read_to_end(&mut head)
        .map_err(|e| StepError::io("read_file", &shown, &e))?;
    // Keep hashing past the limit so the digest covers the whole file.
    let mut hasher = Sha256::new();
    hasher.update(&head);
    let mut tail_hasher = HashWriter(&mut hasher);
    let rest = std::io::copy(&mut file, &mut tail_hasher)
        .map_err(|e| StepError::io("read_file", &shown, &e))?;
    let truncated = rest > 0;
    let size_bytes = head.len() as u64 + rest;
    let sha256 = hex::encode(hasher.finalize());
    let (content, encoding) = encode(head, truncated);
    Ok(StepOutput::ReadFile(ReadFileOutput {
        content,
        encoding,
        size_bytes,
        truncated,
        sha256,
    }))
}

/// Feeds written bytes into a hasher.
struct HashWriter<'a>(&'a mut Sha256);

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// UTF-8 text stays text (a character cut by truncation is dropped); anything else is
/// base64.
fn encode(bytes: Vec<u8>, truncated: bool) -> (String, ContentEncoding) {
    match String::from_utf8(bytes) {
        Ok(s) => (s, ContentEncoding::Utf8),
        Err(e) => {
            let utf8 = e.utf8_error();
            let bytes = e.into_bytes();
            if truncated && utf8.error_len().is_none() {
                let valid = String::from_utf8_lossy(&bytes[..utf8.valid_up_to()]).into_owned();
                return (valid, ContentEncoding::Utf8);
            }
            (
                base64::engine::general_purpose::STANDARD.encode(&bytes),
                ContentEncoding::Base64,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_binary_and_cut_characters() {
        assert_eq!(
            encode(b"hi".to_vec(), false),
            ("hi".into(), ContentEncoding::Utf8)
        );
        assert_eq!(
            encode(vec![0xff, 0], false),
            ("/wA=".into(), ContentEncoding::Base64)
        );
        // "é" is two bytes; a cut after the first keeps "a".
        assert_eq!(
            encode(vec![b'a', 0xc3], true),
            ("a".into(), ContentEncoding::Utf8)
        );
    }
}
