//! RFC 9457 problem details: the one error body of every HTTP API in CyNode (the worker's
//! and the PM's), with one scheme for its `type` (`urn:cynodeai:error:<kind>`, the scheme
//! upstream CyNodeAI uses) and one vocabulary of kinds, [`ProblemKind`], that both
//! programs build their problems from.
//!
//! The vocabulary is upstream's: the six kinds of its `go_shared_libs/contracts/problem`
//! (`validation`, `authentication`, `authorization`, `not_found`, `rate_limit`,
//! `internal`), spelled as upstream spells them, and used for what upstream uses them for
//! (its Worker API answers 400, 405 and 413 with `validation`). Three kinds are CyNode's
//! own, in the same snake_case, for answers upstream gives no `urn:cynodeai:error:` kind:
//! `conflict` (409), `timeout` (408) and `unavailable` (503, a dependency is down).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What every problem `type` starts with.
pub const TYPE_PREFIX: &str = "urn:cynodeai:error:";
/// The media type of a problem body.
pub const CONTENT_TYPE: &str = "application/problem+json";

/// The one vocabulary of problem kinds: the last part of every `type` CyNode sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProblemKind {
    /// The request is refused for what it says: a field, its size (413), its media type
    /// (415), its method (405). Upstream's.
    Validation,
    /// No valid credentials (401). Upstream's.
    Authentication,
    /// Valid credentials that may not do this (403). Upstream's.
    Authorization,
    /// The resource does not exist, or is not the caller's to see (404). Upstream's.
    NotFound,
    /// At capacity: retry later (429, or 503 with `Retry-After`). Upstream's.
    RateLimit,
    /// The server failed (500, and a 5xx without a kind of its own). Upstream's.
    Internal,
    /// The request contradicts the resource's state (409). CyNode's.
    Conflict,
    /// The request took longer than the server allows (408). CyNode's.
    Timeout,
    /// A dependency (the datastore, a worker) is down (503). CyNode's.
    Unavailable,
}

impl ProblemKind {
    /// Every kind, upstream's six first.
    pub const ALL: [ProblemKind; 9] = [
        ProblemKind::Validation,
        ProblemKind::Authentication,
        ProblemKind::Authorization,
        ProblemKind::NotFound,
        ProblemKind::RateLimit,
        ProblemKind::Internal,
        ProblemKind::Conflict,
        ProblemKind::Timeout,
        ProblemKind::Unavailable,
    ];

    /// The kind's `type`: [`TYPE_PREFIX`] and its name.
    pub const fn type_uri(self) -> &'static str {
        match self {
            ProblemKind::Validation => "urn:cynodeai:error:validation",
            ProblemKind::Authentication => "urn:cynodeai:error:authentication",
            ProblemKind::Authorization => "urn:cynodeai:error:authorization",
            ProblemKind::NotFound => "urn:cynodeai:error:not_found",
            ProblemKind::RateLimit => "urn:cynodeai:error:rate_limit",
            ProblemKind::Internal => "urn:cynodeai:error:internal",
            ProblemKind::Conflict => "urn:cynodeai:error:conflict",
            ProblemKind::Timeout => "urn:cynodeai:error:timeout",
            ProblemKind::Unavailable => "urn:cynodeai:error:unavailable",
        }
    }

    /// The kind's name, the part of its `type` after [`TYPE_PREFIX`] (`not_found`).
    pub fn name(self) -> &'static str {
        &self.type_uri()[TYPE_PREFIX.len()..]
    }

    /// Whether upstream CyNodeAI defines this kind (its `problem.Type*` constants).
    pub const fn is_upstream(self) -> bool {
        !matches!(
            self,
            ProblemKind::Conflict | ProblemKind::Timeout | ProblemKind::Unavailable
        )
    }

    /// The kind a `type` names, or `None` for a URI outside the vocabulary (a peer may
    /// send one: upstream's orchestrator sends `https://cynode.ai/specs/conflict`).
    pub fn from_type(uri: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.type_uri() == uri)
    }

    /// The kind of an error answer with HTTP `status` that has no more specific one (a
    /// framework's rejection, a layer's 408 or 413), as upstream's Worker API chooses it.
    pub fn for_status(status: u16) -> Self {
        match status {
            401 => ProblemKind::Authentication,
            403 => ProblemKind::Authorization,
            404 => ProblemKind::NotFound,
            408 => ProblemKind::Timeout,
            409 => ProblemKind::Conflict,
            429 => ProblemKind::RateLimit,
            503 => ProblemKind::Unavailable,
            400..=499 => ProblemKind::Validation,
            _ => ProblemKind::Internal,
        }
    }
}

impl std::fmt::Display for ProblemKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One problem (RFC 9457).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Problem {
    /// A URI naming the problem type: `urn:cynodeai:error:` and one kind of the
    /// vocabulary: `validation`, `authentication`, `authorization`, `not_found`,
    /// `rate_limit`, `internal` (upstream CyNodeAI's), `conflict`, `timeout`, `unavailable`.
    /// Read tolerantly: a peer may send another URI.
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
}

impl Problem {
    /// A problem of `kind` with HTTP `status`.
    pub fn new(
        status: u16,
        kind: ProblemKind,
        title: impl Into<String>,
        detail: Option<String>,
    ) -> Self {
        Problem {
            kind: kind.type_uri().to_string(),
            title: title.into(),
            status,
            detail,
            instance: None,
        }
    }

    /// The kind of the vocabulary this problem's `type` names, if it names one.
    pub fn problem_kind(&self) -> Option<ProblemKind> {
        ProblemKind::from_type(&self.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_follows_the_one_scheme() {
        let p = Problem::new(
            404,
            ProblemKind::NotFound,
            "Not Found",
            Some("job j".into()),
        );
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["type"], "urn:cynodeai:error:not_found");
        assert_eq!(p.problem_kind(), Some(ProblemKind::NotFound));
        assert!(v.get("instance").is_none());
        let back: Problem = serde_json::from_value(v).unwrap();
        assert_eq!(back, p);
    }

    /// Upstream's six kinds, as `go_shared_libs/contracts/problem/problem.go` of
    /// cypher0n3/CyNodeAI defines them on `main` and on `mvp/phase-2` (d59af45).
    const UPSTREAM: [&str; 6] = [
        "urn:cynodeai:error:validation",
        "urn:cynodeai:error:authentication",
        "urn:cynodeai:error:authorization",
        "urn:cynodeai:error:not_found",
        "urn:cynodeai:error:rate_limit",
        "urn:cynodeai:error:internal",
    ];

    #[test]
    fn the_vocabulary_is_upstreams_and_snake_case() {
        let ours: Vec<&str> = ProblemKind::ALL
            .iter()
            .filter(|k| k.is_upstream())
            .map(|k| k.type_uri())
            .collect();
        assert_eq!(ours, UPSTREAM);
        for (i, k) in ProblemKind::ALL.iter().enumerate() {
            let name = k.name();
            assert_eq!(k.type_uri(), format!("{TYPE_PREFIX}{name}"));
            assert!(
                name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{name}: snake_case, as upstream's `not_found`"
            );
            assert_eq!(ProblemKind::from_type(k.type_uri()), Some(*k));
            assert!(ProblemKind::ALL[..i].iter().all(|o| o.name() != name));
        }
        assert_eq!(ProblemKind::from_type("urn:cynodeai:error:not-found"), None);
        assert_eq!(
            ProblemKind::from_type("https://cynode.ai/specs/conflict"),
            None
        );
    }

    #[test]
    fn statuses_map_as_upstreams_worker_api_maps_them() {
        use ProblemKind::*;
        for (status, kind) in [
            (400, Validation),
            (405, Validation),
            (413, Validation),
            (415, Validation),
            (422, Validation),
            (401, Authentication),
            (403, Authorization),
            (404, NotFound),
            (408, Timeout),
            (409, Conflict),
            (429, RateLimit),
            (500, Internal),
            (502, Internal),
            (503, Unavailable),
        ] {
            assert_eq!(ProblemKind::for_status(status), kind, "{status}");
        }
    }
}
