//! Worker API health body: `GET /readyz` with `Accept: application/json` answers a
//! [`Readiness`] (200 when ready, 503 when not); without it, upstream CyNodeAI's text.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Whether the node can take jobs, as last checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Readiness {
    pub ready: bool,
    /// The backend and its version, or why the node is not ready.
    pub detail: String,
}
