//! Tests that span the workspace: the PM driving real workers, sandboxes and model
//! servers through its binary and its HTTP service, the deployment manifests read with
//! both programs' config types, and the architecture map. The shared support is the
//! `cynode_tests` library (binaries, scripted model, processes).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod agent_task;
mod api_input;
mod architecture;
mod babble;
mod datastore_outage;
mod deploy;
mod e2e;
mod egress_e2e;
mod evidence;
mod gateway;
mod gateway_egress_e2e;
mod hosted_model;
mod listeners;
mod mcp;
mod otel;
mod pm_sandboxes;
mod reliability;
mod service;
mod skill_run;
mod tls;
mod tls_services;
mod upstream;
mod worker_tls;
mod workers;
