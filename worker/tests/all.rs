//! Integration tests of cynode-worker: the real server on 127.0.0.1 with real Podman and
//! bubblewrap sandboxes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

/// `on_both_backends!(module: case, …)`: one test per case and backend, named
/// `bwrap::case`, `podman::case`, `docker::case` and `runsc::case` (gVisor under Podman),
/// that runs `crate::module::case("bwrap" | "podman" | "docker" | "runsc")` after the
/// environment setup (the harness turns the name into the worker's config). A case listed
/// in `gaps.rs` for an engine must still fail there, with the documented reason. Defined
/// before the modules, so each can use it.
macro_rules! on_both_backends {
    ($module:ident: $($case:ident),* $(,)?) => {
        on_both_backends!(@one $module podman: $($case),*);
        on_both_backends!(@one $module bwrap: $($case),*);
        on_both_backends!(@one $module docker: $($case),*);
        on_both_backends!(@one $module runsc: $($case),*);
    };
    (@one $module:ident $backend:ident: $($case:ident),*) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    crate::cases::setup();
                    let backend = stringify!($backend);
                    let case = crate::$module::$case(backend);
                    match crate::gaps::known(backend, stringify!($module), stringify!($case)) {
                        None => case.await,
                        Some(gap) => crate::gaps::still_fails(gap, case).await,
                    }
                }
            )*
        }
    };
}

mod backends;
mod cases;
mod disk_attacks;
mod disk_unlinked;
mod disk_volumes;
mod egress;
mod egress_jobs;
mod engine_check;
mod gaps;
mod gateway;
mod hardening;
mod harness;
mod host_reads;
mod host_writes;
mod inference;
mod listeners;
mod microvm;
mod sandbox_escapes;
mod sessions;
mod syscall_probe;
mod tenant_uids;
mod tls;
mod upstream;
mod workspace_attacks;
mod workspaces;
