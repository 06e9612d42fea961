//! RFC 9457 problem details: the one error body of every HTTP API in CyNode (the worker's
//! and the PM's), with one scheme for its `type`: `urn:cynodeai:error:<kind>`, the scheme
//! upstream CyNodeAI uses.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What every problem `type` starts with.
pub const TYPE_PREFIX: &str = "urn:cynodeai:error:";
/// The media type of a problem body.
pub const CONTENT_TYPE: &str = "application/problem+json";

/// One problem (RFC 9457).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Problem {
    /// A URI naming the problem type: [`TYPE_PREFIX`] and a kind, e.g.
    /// `urn:cynodeai:error:validation`.
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
}

/// The problem `type` for `kind`: `urn:cynodeai:error:<kind>`.
pub fn type_uri(kind: &str) -> String {
    format!("{TYPE_PREFIX}{kind}")
}

impl Problem {
    /// A problem of `kind` (the last part of its `type`) with HTTP `status`.
    pub fn new(status: u16, kind: &str, title: impl Into<String>, detail: Option<String>) -> Self {
        Problem {
            kind: type_uri(kind),
            title: title.into(),
            status,
            detail,
            instance: None,
        }
    }

    /// The kind of a problem whose `type` follows [`TYPE_PREFIX`].
    pub fn kind_name(&self) -> Option<&str> {
        self.kind.strip_prefix(TYPE_PREFIX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_follows_the_one_scheme() {
        let p = Problem::new(404, "not_found", "Not Found", Some("job j".into()));
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["type"], "urn:cynodeai:error:not_found");
        assert_eq!(p.kind_name(), Some("not_found"));
        assert!(v.get("instance").is_none());
        let back: Problem = serde_json::from_value(v).unwrap();
        assert_eq!(back, p);
    }
}
