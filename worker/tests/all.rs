//! Integration tests of cynode-worker: the real server on 127.0.0.1 with real Podman and
//! bubblewrap sandboxes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod backends;
mod cases;
mod harness;
mod host_reads;
mod inference;
mod sandbox_escapes;
mod sessions;
mod tls;
mod upstream;
mod workspace_attacks;
mod workspaces;
