//! Reading a settings file (a workers file, the API tokens, the tenant policy): one error
//! shape for "cannot read it" and "its content is wrong", naming the file either way.

use std::path::{Path, PathBuf};

/// A settings file that could not be read, or whose content `parse` refused.
#[derive(Debug, thiserror::Error)]
pub enum FileError<E: std::error::Error> {
    #[error("cannot read the {what} {}: {cause}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("in {}: {cause}", path.display())]
    Content { path: PathBuf, cause: E },
}

/// Reads the `what` at `path` and parses it with `parse`.
pub fn load<T, E: std::error::Error>(
    what: &'static str,
    path: &Path,
    parse: impl FnOnce(&str) -> Result<T, E>,
) -> Result<T, FileError<E>> {
    let text = std::fs::read_to_string(path).map_err(|cause| FileError::Read {
        what,
        path: path.to_path_buf(),
        cause,
    })?;
    parse(&text).map_err(|cause| FileError::Content {
        path: path.to_path_buf(),
        cause,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn errors_name_the_file_and_what_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let error_of = |path: &std::path::Path| {
            let e = super::load("workers file", path, |t| t.parse::<u8>()).unwrap_err();
            e.to_string()
        };
        let text = error_of(&dir.path().join("nope.yaml"));
        assert!(text.starts_with("cannot read the workers file "), "{text}");
        assert!(text.contains("nope.yaml"), "{text}");
        let bad = dir.path().join("bad");
        std::fs::write(&bad, "x").unwrap();
        assert_eq!(
            error_of(&bad),
            format!("in {}: invalid digit found in string", bad.display())
        );
    }
}
