//! Integration tests of cynode-pm.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod api_input;
mod e2e;
mod llm;
mod otel;
mod policy;
mod reliability;
mod service;
mod skills;
mod store;
mod tls;
mod tls_services;
mod upstream;
mod worker_tls;
mod workers;
