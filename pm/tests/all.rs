//! Integration tests of cynode-pm.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cli;
mod egress;
mod gateway_egress;
mod job_context;
mod llm;
mod plan_bounds;
mod policy;
mod seed_words;
mod skills;
mod skills_fetch;
mod store;
mod web_search;
