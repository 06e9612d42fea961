//! Image references checked against the OCI distribution reference grammar, so that no
//! request value can reach an engine's argv as anything but an image name.
//!
//! The grammar (distribution/reference, `reference.go`):
//!
//! ```text
//! reference        := name [ ":" tag ] [ "@" digest ]
//! name             := [domain '/'] path-component ['/' path-component]*
//! domain           := host [':' port-number]
//! host             := domain-name | '[' IPv6address ']'
//! domain-name      := domain-component ['.' domain-component]*
//! domain-component := /([a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])/
//! path-component   := /[a-z0-9]+/ [separator /[a-z0-9]+/]*
//! separator        := /[_.]|__|[-]*/
//! tag              := /[\w][\w.-]{0,127}/
//! digest           := algorithm ":" /[0-9a-fA-F]{32,}/
//! algorithm        := /[A-Za-z][A-Za-z0-9]*/ [/[+.-_]/ /[A-Za-z][A-Za-z0-9]*/]*
//! ```
//!
//! and a name of at most 255 characters. Every valid reference starts with a letter, a
//! digit or `[`: never with `-`.

use std::sync::OnceLock;

use regex::Regex;

/// Longest name (the part before `:tag` / `@digest`) the grammar allows.
pub const NAME_TOTAL_LENGTH_MAX: usize = 255;

fn grammar() -> Option<&'static Regex> {
    static RE: OnceLock<Option<Regex>> = OnceLock::new();
    RE.get_or_init(|| {
        let domain_component = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])";
        let host = format!(r"(?:{domain_component}(?:\.{domain_component})*|\[[0-9a-fA-F:]+\])");
        let domain = format!(r"{host}(?::[0-9]+)?");
        let path_component = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*";
        let name = format!(r"(?:{domain}/)?{path_component}(?:/{path_component})*");
        let tag = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}";
        let digest = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}";
        Regex::new(&format!(r"^({name})(?::{tag})?(?:@{digest})?$")).ok()
    })
    .as_ref()
}

/// Why a string is not an image reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageRefError {
    #[error("must not be empty")]
    Empty,
    #[error("is not an OCI image reference (name[:tag][@digest])")]
    Malformed,
    #[error("name is longer than {NAME_TOTAL_LENGTH_MAX} characters")]
    TooLong,
}

/// Checks `image` against the reference grammar.
pub fn check(image: &str) -> Result<(), ImageRefError> {
    if image.is_empty() {
        return Err(ImageRefError::Empty);
    }
    let caps = grammar()
        .and_then(|re| re.captures(image))
        .ok_or(ImageRefError::Malformed)?;
    let name_len = caps.get(1).map_or(0, |m| m.as_str().len());
    if name_len > NAME_TOTAL_LENGTH_MAX {
        return Err(ImageRefError::TooLong);
    }
    Ok(())
}

/// Whether `image` is a valid reference.
pub fn is_valid(image: &str) -> bool {
    check(image).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_usual_forms() {
        for ok in [
            "alpine",
            "alpine:3.19",
            "library/alpine",
            "docker.io/library/alpine:latest",
            "localhost/cynode-sba-test:latest",
            "localhost:5000/team/img:v1.2-rc_3",
            "registry.example.com:443/a/b/c",
            "my_image__x.y-z",
            "[::1]:5000/img:tag",
            "img@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "img:tag@sha256:0123456789abcdef0123456789abcdef",
            "Registry.Example/img",
        ] {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn refuses_flags_and_malformed_references() {
        for bad in [
            "--volume=/:/host:rw",
            "-v",
            "--privileged",
            "-",
            " alpine",
            "alpine ",
            "alpine\n--privileged",
            "Alpine/Img",
            "img:",
            "img:-tag",
            "img:.tag",
            "img@sha256:short",
            "img@sha256:",
            "a//b",
            "a/-b",
            "a/b-",
            "a_",
            ":tag",
            "@sha256:0123456789abcdef0123456789abcdef",
            "img;rm -rf /",
            "img:tag:tag",
            "img:t ag",
            "ünicode",
        ] {
            assert!(check(bad).is_err(), "{bad:?} must be refused");
        }
        assert_eq!(check(""), Err(ImageRefError::Empty));
        let tag = format!("img:{}", "t".repeat(129));
        assert!(check(&tag).is_err());
        assert!(check(&format!("img:{}", "t".repeat(128))).is_ok());
    }

    #[test]
    fn bounds_the_name_length() {
        let long = format!("a/{}", "b".repeat(254));
        assert_eq!(check(&long), Err(ImageRefError::TooLong));
        let fits = "b".repeat(255);
        assert_eq!(check(&fits), Ok(()));
    }
}
