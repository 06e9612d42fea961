//! W3C trace context on incoming Worker API calls: a valid `traceparent` header puts the
//! request (and the job it starts) in a `request` span carrying the caller's `trace_id`,
//! so the worker's log lines for that job can be joined with the caller's trace.
//! The worker exports no spans itself.

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

/// The trace id and parent span id of a W3C `traceparent` value
/// (`{version}-{trace-id}-{parent-id}-{flags}`, lowercase hex), or `None` when it is not
/// valid: a wrong length or character, version `ff`, or an all-zero id.
pub fn parse_traceparent(value: &str) -> Option<(&str, &str)> {
    let mut parts = value.trim().split('-');
    let version = parts.next()?;
    let trace_id = parts.next()?;
    let parent_id = parts.next()?;
    let flags = parts.next()?;
    let hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    let ok = hex(version, 2)
        && version != "ff"
        // Version 00 has exactly four fields; later versions may append more.
        && (version != "00" || parts.next().is_none())
        && hex(trace_id, 32)
        && nonzero(trace_id)
        && hex(parent_id, 16)
        && nonzero(parent_id)
        && hex(flags, 2);
    ok.then_some((trace_id, parent_id))
}

/// Middleware: runs a request that carries a valid `traceparent` inside a `request`
/// span with its `trace_id` and `parent_span_id`; other requests run as before.
pub async fn traced(req: Request, next: Next) -> Response {
    let ids = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_traceparent)
        .map(|(t, p)| (t.to_string(), p.to_string()));
    match ids {
        Some((trace_id, parent)) => {
            let span = tracing::info_span!(
                "request",
                trace_id = %trace_id,
                parent_span_id = %parent,
                method = %req.method(),
                path = %req.uri().path(),
            );
            next.run(req).instrument(span).await
        }
        None => next.run(req).await,
    }
}

#[cfg(test)]
mod tests {
    use super::parse_traceparent;

    #[test]
    fn valid_traceparents_give_their_ids() {
        assert_eq!(
            parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"))
        );
        // A future version may carry more fields.
        assert_eq!(
            parse_traceparent("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-xyz"),
            Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"))
        );
    }

    #[test]
    fn invalid_traceparents_are_ignored() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad:?}");
        }
    }
}
