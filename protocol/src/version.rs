//! Protocol version handling: major must be 1, any minor is accepted.

use crate::error::ValidationError;

/// The version this build writes.
pub const PROTOCOL_VERSION: &str = "1.0";
/// The only major version this build reads.
pub const SUPPORTED_MAJOR: u64 = 1;

/// Checks a `protocol_version` such as `"1"`, `"1.0"` or `"1.3"`.
pub fn check(field: &str, version: &str) -> Result<(u64, u64), ValidationError> {
    let mut parts = version.split('.');
    let parse = |p: Option<&str>| -> Option<u64> {
        let p = p?;
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        p.parse().ok()
    };
    let major = parse(parts.next());
    let minor = match parts.next() {
        None => Some(0),
        some => parse(some),
    };
    let (Some(major), Some(minor), None) = (major, minor, parts.next()) else {
        return Err(ValidationError::new(
            field,
            format!("invalid version `{version}`: expected MAJOR or MAJOR.MINOR"),
        ));
    };
    if major != SUPPORTED_MAJOR {
        return Err(ValidationError::new(
            field,
            format!(
                "unsupported major version {major}: this runner reads protocol {SUPPORTED_MAJOR}.x"
            ),
        ));
    }
    Ok((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_minor_versions() {
        assert_eq!(check("v", "1"), Ok((1, 0)));
        assert_eq!(check("v", "1.0"), Ok((1, 0)));
        assert_eq!(check("v", "1.3"), Ok((1, 3)));
    }

    #[test]
    fn rejects_other_majors_and_garbage() {
        assert_eq!(
            check("protocol_version", "99.0"),
            Err(ValidationError::new(
                "protocol_version",
                "unsupported major version 99: this runner reads protocol 1.x"
            ))
        );
        for bad in ["", "1.", ".1", "1.0.0", "one", "1.x", "-1"] {
            assert!(check("v", bad).is_err(), "{bad}");
        }
    }
}
