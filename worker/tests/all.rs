//! Integration tests of cynode-worker: the real server on 127.0.0.1 with real Podman and
//! bubblewrap sandboxes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

/// The backends the shared suites run on: the one list, as the harness names them (its
/// worker config for each is `harness::backend_config`; `runsc` is Podman with gVisor's
/// runtime). `backend_list!(callback args…)` expands to
/// `callback!(args… [every shared suite] [the contract suite only])`: the first group runs
/// every suite written with [`on_both_backends!`], the second only the contract suite
/// (`backends.rs`, [`on_every_backend!`]; its own attack tests are its module's). A case
/// that does not hold on a backend is listed in `gaps.rs` and must still fail there.
/// `backends::every_backend_kind_is_in_the_list` fails when a `BackendKind` is missing.
macro_rules! backend_list {
    ($callback:ident $($args:tt)*) => {
        $callback!($($args)* [podman, bwrap, docker, runsc] [microvm]);
    };
}

/// `SHARED_BACKENDS` and `CONTRACT_ONLY_BACKENDS`: the list of [`backend_list!`] as names.
macro_rules! backend_names {
    ([$($shared:ident),*] [$($contract:ident),*]) => {
        /// The backends every shared suite runs on.
        pub const SHARED_BACKENDS: &[&str] = &[$(stringify!($shared)),*];
        /// The backends only the contract suite runs on.
        pub const CONTRACT_ONLY_BACKENDS: &[&str] = &[$(stringify!($contract)),*];
    };
}
backend_list!(backend_names);

/// `on_both_backends!(module: case, …)`: one test per case and backend of the first group
/// of [`backend_list!`], named `<backend>::case` (`bwrap::case`, `podman::case`, …), that
/// runs `crate::module::case("<backend>")` after the environment setup (the harness turns
/// the name into the worker's config). A case listed in `gaps.rs` for a backend must
/// still fail there, with the documented reason. Defined before the modules, so each can
/// use it.
macro_rules! on_both_backends {
    ($module:ident: $($case:ident),* $(,)?) => {
        backend_list!(on_both_backends @shared $module [$($case),*]);
    };
    (@shared $module:ident $cases:tt [$($backend:ident),*] [$($contract:ident),*]) => {
        $( on_both_backends!(@one $module $backend $cases); )*
    };
    (@one $module:ident $backend:ident [$($case:ident),*]) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let backend = stringify!($backend);
                    crate::cases::setup_for(backend);
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

/// `on_every_backend!(module: case, …)`: as [`on_both_backends!`], on every backend of
/// [`backend_list!`] (both groups): the contract suite.
macro_rules! on_every_backend {
    ($module:ident: $($case:ident),* $(,)?) => {
        backend_list!(on_every_backend @all $module [$($case),*]);
    };
    (@all $module:ident $cases:tt [$($backend:ident),*] [$($contract:ident),*]) => {
        $( on_both_backends!(@one $module $backend $cases); )*
        $( on_both_backends!(@one $module $contract $cases); )*
    };
}

mod agent_images;
mod backends;
mod bwrap_starters;
mod bwrap_warm;
mod cases;
mod disk_attacks;
mod disk_unlinked;
mod disk_volumes;
mod egress;
mod egress_jobs;
mod egress_toolchains;
mod engine_check;
mod gaps;
mod gateway;
mod hardening;
mod harness;
mod host_paths;
mod host_reads;
mod host_writes;
mod inference;
mod janitor;
mod job_home;
mod listeners;
mod microvm;
mod sandbox_escapes;
mod session_egress;
mod session_files;
mod session_snapshots;
mod session_stdin;
mod session_streams;
mod session_suspend;
mod session_waiter;
mod sessions;
mod syscall_probe;
mod tenant_uids;
mod tls;
mod upstream;
mod warm_pool;
mod workspace_attacks;
mod workspaces;
