//! `GET /v1/sessions/{id}/events`: the session's history as Server-Sent Events.
//!
//! Every event the loop records (created, model_reply, job_dispatched, job_state,
//! job_result, policy_denied, question, user_answer, final, canceled…) is sent once, in
//! order, with its sequence number as the SSE `id`. A client that reconnects with
//! `Last-Event-ID: N` gets exactly the events after N. The events are read from the
//! database, so any replica serves any session's stream, whichever replica drives it. The
//! stream ends after the event that made the session terminal.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;

use crate::app::auth::Tenant;
use crate::app::ops::owned;
use crate::app::problem::Problem;
use crate::app::AppState;

/// How often an open stream looks for new events.
const POLL: Duration = Duration::from_millis(200);

struct Cursor {
    st: Arc<AppState>,
    id: String,
    after: u64,
    pending: VecDeque<Event>,
    done: bool,
}

/// Stream the session's events (resumable with `Last-Event-ID`).
#[utoipa::path(get, path = "/v1/sessions/{id}/events", params(("id" = String, Path),
        ("Last-Event-ID" = Option<u64>, Header, description = "resume after this event")),
    responses((status = 200, content_type = "text/event-stream", description = "events: id = seq, event = kind, data = {seq, at, kind, data}"),
              (status = 404, body = Problem)),
    security(("bearer" = [])))]
pub async fn session_events(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    owned(&st, &tenant, &id).await?;
    let after = match headers.get("last-event-id").map(|v| v.to_str()) {
        None => 0,
        Some(Ok(v)) => v
            .trim()
            .parse::<u64>()
            .map_err(|_| Problem::bad_request("Last-Event-ID: must be an event sequence number"))?,
        Some(Err(_)) => return Err(Problem::bad_request("Last-Event-ID: not text")),
    };
    let cursor = Cursor {
        st,
        id,
        after,
        pending: VecDeque::new(),
        done: false,
    };
    let events = stream::unfold(cursor, |mut c| async move {
        loop {
            if let Some(e) = c.pending.pop_front() {
                return Some((Ok::<Event, Infallible>(e), c));
            }
            if c.done {
                return None;
            }
            match c.st.pm.store.load(&c.id).await {
                Ok(Some((rec, _))) => {
                    let after = c.after;
                    for h in rec.state.history.iter().filter(|h| h.seq > after) {
                        let data = serde_json::json!({
                            "seq": h.seq, "at": h.at, "kind": h.kind, "data": h.data,
                        });
                        c.pending.push_back(
                            Event::default()
                                .id(h.seq.to_string())
                                .event(h.kind.clone())
                                .data(data.to_string()),
                        );
                        c.after = h.seq;
                    }
                    c.done = rec.status.is_terminal();
                }
                Ok(None) => c.done = true,
                Err(e) => {
                    tracing::warn!(session_id = %c.id, error = %e, "event stream cannot read the session")
                }
            }
            if c.pending.is_empty() && !c.done {
                tokio::select! {
                    _ = tokio::time::sleep(POLL) => {}
                    // The replica is shutting down: end the stream; the client resumes
                    // on another replica with Last-Event-ID.
                    _ = c.st.stop.cancelled() => c.done = true,
                }
            }
        }
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}
