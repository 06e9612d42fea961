//! The MCP server of `cynode-pm mcp` ([`PmMcp`]): rmcp's `ServerHandler` over the tools
//! of [`super::tools`], for one fixed tenant (stdio) or the tenant an API token named
//! (streamable HTTP, set by [`super::http`]'s authentication in front of it).
//!
//! Errors are structured both ways MCP has: an unknown tool or arguments that do not
//! fit the tool's schema are JSON-RPC errors (-32602, `data.type` a
//! `urn:cynodeai:error:` kind of the one vocabulary, [`ProblemKind`]: `not_found` for
//! an unknown tool, `validation` with `data.detail` naming the field); an operation that ran
//! and was refused (not found, conflict, forbidden) is a tool result with `isError` and
//! the RFC 9457 problem as its structured content, as the HTTP API would answer.

use std::sync::Arc;

use cynode_protocol::problem::ProblemKind;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ErrorData, Implementation,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::ServerHandler;
use serde_json::json;

use super::tools::{self, ToolError};
use crate::app::auth::Tenant;
use crate::app::AppState;

/// The PM's MCP tools for one caller.
#[derive(Clone)]
pub struct PmMcp {
    st: Arc<AppState>,
    /// The caller's tenant over stdio; over HTTP it comes with each request.
    tenant: Option<Tenant>,
}

impl PmMcp {
    /// The tools for `tenant` (stdio: the one local caller).
    pub fn for_tenant(st: Arc<AppState>, tenant: Tenant) -> Self {
        PmMcp {
            st,
            tenant: Some(tenant),
        }
    }

    /// The tools for the tenant each HTTP request was authenticated as.
    pub fn per_request(st: Arc<AppState>) -> Self {
        PmMcp { st, tenant: None }
    }

    /// Whether `name` is offered here: [`tools::LOCAL_ONLY`] only to the local caller.
    fn offers(&self, name: &str) -> bool {
        self.tenant.is_some() || !tools::LOCAL_ONLY.contains(&name)
    }

    fn tenant(&self, ctx: &RequestContext<RoleServer>) -> Option<Tenant> {
        if let Some(t) = &self.tenant {
            return Some(t.clone());
        }
        ctx.extensions
            .get::<axum::http::request::Parts>()
            .and_then(|p| p.extensions.get::<Tenant>())
            .cloned()
    }
}

/// A tool of `spec` as `tools/list` shows it.
fn tool(spec: tools::ToolSpec) -> Tool {
    Tool::new(spec.name, spec.description, spec.input_schema)
        .with_annotations(ToolAnnotations::new().read_only(spec.read_only))
}

/// An error of a tool call, as MCP carries it.
pub fn error_response(e: ToolError) -> Result<CallToolResponse, ErrorData> {
    match e {
        ToolError::UnknownTool(name) => Err(ErrorData::invalid_params(
            format!("unknown tool `{name}`"),
            Some(json!({ "type": ProblemKind::NotFound.type_uri(), "tool": name })),
        )),
        ToolError::BadArguments(detail) => Err(ErrorData::invalid_params(
            detail.clone(),
            Some(json!({ "type": ProblemKind::Validation.type_uri(), "detail": detail })),
        )),
        ToolError::Problem(p) => Ok(CallToolResult::structured_error(json!(p.0)).into()),
        ToolError::Failed(v) => Ok(CallToolResult::structured_error(v).into()),
    }
}

impl ServerHandler for PmMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("cynode-pm", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "The CyNode project manager: create a session with an objective, follow its \
                 events until it is done, answer its questions, fetch its verified artifacts.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(
            tools::catalog()
                .into_iter()
                .filter(|t| self.offers(t.name))
                .map(tool)
                .collect(),
        ))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        tools::catalog()
            .into_iter()
            .find(|t| t.name == name && self.offers(t.name))
            .map(tool)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let Some(tenant) = self.tenant(&context) else {
            // The HTTP mount authenticates before rmcp sees the request; this is a
            // mount without it, refused rather than run as nobody.
            return Err(ErrorData::invalid_request(
                "unauthorized",
                Some(json!({ "type": ProblemKind::Authentication.type_uri() })),
            ));
        };
        if !self.offers(&request.name) {
            return error_response(ToolError::UnknownTool(request.name.to_string()));
        }
        let args = request.arguments.unwrap_or_default();
        match tools::call(&self.st, &tenant, &request.name, &args).await {
            Ok(v) => Ok(CallToolResult::structured(v).into()),
            Err(e) => {
                tracing::info!(tool = %request.name, tenant = %tenant.0, error = %e, "mcp tool call refused");
                error_response(e)
            }
        }
    }
}
