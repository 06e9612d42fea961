//! Validation errors that always name the field path they are about.

use std::fmt;

/// One problem with a document, located by a field path such as
/// `constraints.max_runtime_seconds` or `steps[2].arguments.path`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ValidationError {
    /// Dotted field path; `.` for the document itself.
    pub path: String,
    /// Lowercase message without a trailing period.
    pub message: String,
}

impl ValidationError {
    /// Builds an error for `path`.
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }

    /// Converts a serde error located by `serde_path_to_error` into a field-named error.
    ///
    /// Nested parsers (step arguments) report their own relative path by prefixing the
    /// message with `@<relative path>@`; that prefix is joined onto the outer path here, so
    /// `steps[0]` + `@arguments.command@missing field` becomes `steps[0].arguments.command`.
    pub fn from_serde(err: serde_path_to_error::Error<serde_json::Error>) -> Self {
        let outer = err.path().to_string();
        let inner = err.inner();
        let raw = strip_serde_position(&inner.to_string());
        let (path, message) = match split_nested(&raw) {
            Some((rel, msg)) => (join_path(&outer, rel), msg.to_string()),
            None => (outer, raw),
        };
        let path = if path.is_empty() {
            ".".to_string()
        } else {
            path
        };
        Self { path, message }
    }

    /// Encodes an error from a nested parse so [`ValidationError::from_serde`] can join paths.
    pub fn nested_message(rel_path: &str, message: &str) -> String {
        format!("@{rel_path}@{message}")
    }

    /// This error as a nested message (see [`ValidationError::nested_message`]), its path
    /// relative to where the nested parse began (`.` is the place itself).
    pub fn relative(&self) -> String {
        let path = if self.path == "." { "" } else { &self.path };
        Self::nested_message(path, &self.message)
    }
}

fn split_nested(raw: &str) -> Option<(&str, &str)> {
    let rest = raw.strip_prefix('@')?;
    let end = rest.find('@')?;
    Some((&rest[..end], &rest[end + 1..]))
}

fn join_path(outer: &str, rel: &str) -> String {
    match (
        outer.is_empty() || outer == ".",
        rel.is_empty() || rel == ".",
    ) {
        (true, _) => rel.to_string(),
        (false, true) => outer.to_string(),
        (false, false) => format!("{outer}.{rel}"),
    }
}

/// serde_json appends " at line L column C"; the path already locates the problem.
fn strip_serde_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(idx) if msg[idx..].contains(" column ") => msg[..idx].to_string(),
        _ => msg.to_string(),
    }
}

/// All problems found in one document; never empty when returned as an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationErrors(pub Vec<ValidationError>);

impl ValidationErrors {
    /// The first error, for callers that report one line.
    pub fn first(&self) -> Option<&ValidationError> {
        self.0.first()
    }
}

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for e in &self.0 {
            if !first {
                f.write_str("; ")?;
            }
            first = false;
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ValidationErrors {}

impl From<ValidationError> for ValidationErrors {
    fn from(e: ValidationError) -> Self {
        Self(vec![e])
    }
}

/// Parses `bytes` as `T` strictly, reporting the failing field path.
pub fn parse_strict<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ValidationError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(de).map_err(ValidationError::from_serde)?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_paths_join() {
        assert_eq!(
            split_nested("@arguments.command@missing field `command`"),
            Some(("arguments.command", "missing field `command`"))
        );
        assert_eq!(join_path("steps[0]", "arguments"), "steps[0].arguments");
        assert_eq!(join_path("", "arguments"), "arguments");
    }

    #[test]
    fn serde_position_is_stripped() {
        assert_eq!(
            strip_serde_position("unknown field `x` at line 1 column 9"),
            "unknown field `x`"
        );
    }
}
