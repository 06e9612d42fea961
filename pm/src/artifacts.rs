//! Content-addressed artifact storage: bytes are verified against the sha256 the sandbox
//! reported in result.json before they are stored as `<dir>/<sha[0..2]>/<sha>`.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// An artifact whose bytes do not match its reported hash (or size).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("artifact {path}: expected sha256 {expected} ({expected_size} bytes), got {actual} ({actual_size} bytes)")]
pub struct IntegrityError {
    pub path: String,
    pub expected: String,
    pub actual: String,
    pub expected_size: u64,
    pub actual_size: u64,
}

/// Why an artifact was not stored.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// The bytes are not what the sandbox reported.
    #[error(transparent)]
    Integrity(#[from] IntegrityError),
    /// The artifact could not be fetched from the worker.
    #[error("could not be fetched: {0}")]
    Fetch(String),
    /// The artifact store could not be written.
    #[error("cannot store it: {0}")]
    Io(#[from] std::io::Error),
}

/// Verifies `bytes` and stores them; returns the storage location.
pub fn verify_and_store(
    dir: &Path,
    path: &str,
    expected_sha: &str,
    expected_size: u64,
    bytes: &[u8],
) -> Result<PathBuf, ArtifactError> {
    let actual = hex::encode(Sha256::digest(bytes));
    if actual != expected_sha || bytes.len() as u64 != expected_size {
        return Err(IntegrityError {
            path: path.to_string(),
            expected: expected_sha.to_string(),
            actual,
            expected_size,
            actual_size: bytes.len() as u64,
        }
        .into());
    }
    let prefix = actual.get(..2).unwrap_or("00");
    let target = dir.join(prefix).join(&actual);
    if !target.exists() {
        std::fs::create_dir_all(dir.join(prefix))?;
        let tmp = target.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &target)?;
    }
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_by_hash_and_refuses_tampered_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let sha = hex::encode(Sha256::digest(b"abc"));
        let loc = verify_and_store(dir.path(), "a.txt", &sha, 3, b"abc").unwrap();
        assert_eq!(loc, dir.path().join(&sha[..2]).join(&sha));
        let e = verify_and_store(dir.path(), "a.txt", &sha, 3, b"abd").unwrap_err();
        assert!(matches!(e, ArtifactError::Integrity(_)), "{e}");
    }
}
