//! Worker API workspace bodies (this project's extension): `POST /v1/worker/workspaces`
//! takes a [`CreateWorkspace`]; it and `PUT …/{id}/tar` answer a [`WorkspaceInfo`].

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `POST /v1/worker/workspaces`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWorkspace {
    pub version: u32,
    pub workspace_id: String,
    /// Host directory to copy in on creation; must lie under a configured seed root.
    #[serde(default)]
    pub seed_from: Option<PathBuf>,
}

/// What a create or seed did.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq, JsonSchema)]
pub struct WorkspaceInfo {
    pub version: u32,
    pub workspace_id: String,
    pub created: bool,
    pub files: u64,
    pub bytes: u64,
    /// Paths left out (secrets, caches, symlinks leading out), relative to the source.
    pub skipped: Vec<String>,
}
