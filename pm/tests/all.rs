//! Integration tests of cynode-pm.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod policy;
mod llm;
mod skills;
mod store;
