//! Integration tests of cynode-pm.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod e2e;
mod llm;
mod otel;
mod policy;
mod service;
mod skills;
mod store;
mod workers;
