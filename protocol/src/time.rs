//! RFC 3339 timestamps as every program writes them: UTC, milliseconds, a `Z` suffix, so
//! that they sort as text.

use ::time::{macros::format_description, OffsetDateTime, UtcOffset};

/// Now, as RFC 3339 UTC with milliseconds (`2026-11-23T20:19:24.123Z`).
pub fn now_rfc3339() -> String {
    format_rfc3339(OffsetDateTime::now_utc())
}

/// `t` as RFC 3339 UTC with milliseconds; its Unix seconds if it cannot be formatted.
pub fn format_rfc3339(t: OffsetDateTime) -> String {
    let fmt =
        format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z");
    t.to_offset(UtcOffset::UTC)
        .format(&fmt)
        .unwrap_or_else(|_| t.unix_timestamp().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_with_milliseconds() {
        let t = ::time::macros::datetime!(2026-11-23 21:19:24.123456 +01:00);
        assert_eq!(format_rfc3339(t), "2026-11-23T20:19:24.123Z");
        assert_eq!(now_rfc3339().len(), "2026-11-23T20:19:24.123Z".len());
    }
}
