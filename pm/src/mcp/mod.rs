//! MCP (the Model Context Protocol, through the official Rust SDK `rmcp`).
//!
//! `cynode-pm mcp`, for MCP clients (coding assistants, IDEs): the tools of [`tools`]
//! (`sessions.*`, `skills.list`, `skills.show`, `artifacts.get`, and the `sandbox.*` of
//! [`sandbox_tools`]) over the service layer,
//! so they keep the HTTP API's tenants, policy and limits:
//! - [`server`]: the rmcp `ServerHandler` and how errors are carried;
//! - [`stdio`]: `cynode-pm mcp` on stdin/stdout for one tenant, with its own scheduler;
//! - [`http`]: the same tools over streamable HTTP at `/v1/mcp` in `serve`, behind the
//!   API tokens.
//!
//! For sandbox agents, [`gateway`]: the tool gateway at `/v1/gateway` behind job tokens
//! ([`crate::gateway`]: minting, allowlist, audit), and [`egress`]: its `web.fetch` and
//! `api.call`, under the egress rules shared with the worker (`cynode-egress`).

pub mod egress;
pub mod gateway;
pub mod http;
pub mod sandbox_tools;
pub mod server;
pub mod stdio;
pub mod tool_kit;
pub mod tools;
