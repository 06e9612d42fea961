//! The Worker API v1 over HTTP: [`app`] builds the router for a [`crate::node::Node`].
//!
//! Health endpoints are open; `/metrics` and every `/v1/` route need the bearer token
//! (constant-time compare). Bodies are limited (413), parsed strictly with field-named errors (400), and
//! every error is an RFC 9457 problem+json body through the one [`error::ApiError`].
//!
//! This is the top layer: the handlers translate HTTP to calls on the node, its sessions
//! and workspaces, and their errors back to statuses; no domain module imports from here.

mod app;
mod auth;
mod capacity;
pub mod error;
pub mod extract;
mod health;
mod jobs;
mod metrics;
pub mod session_execs;
pub mod session_files;
pub mod session_state;
pub mod sessions;
pub mod workspaces;

pub use app::app;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

/// `body` as JSON, with `new_status` for something new and 200 for a repeat of it.
fn new_or_repeat(new: bool, new_status: StatusCode, body: impl serde::Serialize) -> Response {
    let code = if new { new_status } else { StatusCode::OK };
    (code, Json(body)).into_response()
}
