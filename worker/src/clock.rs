//! RFC 3339 timestamps.

/// Now, as RFC 3339 UTC with milliseconds (sortable as text).
pub fn now_rfc3339() -> String {
    format_rfc3339(time::OffsetDateTime::now_utc())
}

/// `t` as RFC 3339 UTC with milliseconds.
pub fn format_rfc3339(t: time::OffsetDateTime) -> String {
    let fmt = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    t.to_offset(time::UtcOffset::UTC)
        .format(&fmt)
        .unwrap_or_else(|_| t.unix_timestamp().to_string())
}
