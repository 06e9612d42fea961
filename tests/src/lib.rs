//! cynode-tests: tests about the whole workspace rather than one crate (see
//! ARCHITECTURE.md, "tests/"). The library holds their shared support: where the
//! workspace is.

use std::path::PathBuf;

/// The workspace root (the directory holding ARCHITECTURE.md).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default()
}
