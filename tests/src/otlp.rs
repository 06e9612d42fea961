//! An in-test OTLP/HTTP trace collector: an axum app that records each
//! `POST /v1/traces` (content type, body) and answers with an empty
//! `ExportTraceServiceResponse`. The test serves it over HTTP or HTTPS (see [`crate::serve`]).

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::post;
use axum::Router;

/// What the collector received: (content type, protobuf body) per export call.
pub type Bodies = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// The collector's app and what it records.
pub fn otlp_collector() -> (Router, Bodies) {
    async fn traces(
        State(b): State<Bodies>,
        headers: axum::http::HeaderMap,
        body: axum::body::Bytes,
    ) -> impl axum::response::IntoResponse {
        let ct = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        b.lock().unwrap().push((ct, body.to_vec()));
        (
            [("content-type", "application/x-protobuf")],
            Vec::<u8>::new(),
        )
    }
    let bodies = Bodies::default();
    let app = Router::new()
        .route("/v1/traces", post(traces))
        .with_state(Arc::clone(&bodies));
    (app, bodies)
}
