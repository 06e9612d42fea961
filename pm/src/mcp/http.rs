//! `cynode-pm mcp` over streamable HTTP, mounted by `serve` at `/v1/mcp` behind the API
//! tokens: every request is authenticated exactly like the HTTP API's (bearer token →
//! tenant, 401 problem+json otherwise) before rmcp sees it, and runs under the service's
//! body limit and request timeout. Stateless (no MCP session to keep on a replica), JSON
//! replies, so any replica answers any call.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};

use super::server::PmMcp;
use crate::app::auth::Tenant;
use crate::app::problem::Problem;
use crate::app::AppState;

/// Where `serve` mounts the MCP endpoint.
pub const PATH: &str = "/v1/mcp";

/// The MCP endpoint as a router to merge into the service's (of any state `S`: it needs
/// none), its requests authenticated against `st.tokens`.
pub fn router<S: Clone + Send + Sync + 'static>(st: Arc<AppState>, max_body: usize) -> Router<S> {
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        .with_max_request_body_bytes(max_body)
        // Any Host: the bearer token, not the name the client used, is what admits a
        // request (the loopback-only default guards unauthenticated local servers).
        .disable_allowed_hosts()
        .with_cancellation_token(st.stop.child_token());
    let tools = PmMcp::per_request(Arc::clone(&st));
    let service = StreamableHttpService::new(
        move || Ok(tools.clone()),
        Arc::new(NeverSessionManager::default()),
        config,
    );
    Router::new()
        .nest_service(PATH, service)
        .layer(axum::middleware::from_fn_with_state(st, authenticate))
}

/// Admits a request with a valid API token, recording its tenant for the tools.
async fn authenticate(State(st): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    let tenant = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|t| st.tokens.tenant(t.trim()))
        .map(|t| Tenant(t.to_string()));
    match tenant {
        Some(t) => {
            req.extensions_mut().insert(t);
            next.run(req).await
        }
        None => Problem::unauthorized().into_response(),
    }
}
