//! The contract suite: every case of `cases.rs`, once per backend of the one list
//! (`backend_list!` in `all.rs`), and the test that the list names every backend kind.

on_every_backend!(
    cases:
    auth_is_required,
    readyz_names_the_backend,
    echo_hello,
    no_network_for_none_and_restricted,
    cynode_env_is_present_and_not_overridable,
    oversized_body_is_413,
    invalid_requests_name_the_field,
    sba_job_end_to_end_with_verified_artifacts,
    in_progress_is_reported_from_the_sandbox,
    missing_result_is_failed_never_success,
    timeout_removes_the_sandbox,
    sigterm_ignoring_job_ends_at_its_timeout,
    fork_bomb_is_contained,
    memory_hog_is_contained,
    resubmit_is_idempotent,
    workspace_persists_across_a_tasks_jobs,
    stop_cancels_and_removes,
    full_queue_answers_503,
    kill9_restart_keeps_results_and_fails_the_interrupted,
    graceful_shutdown_finishes_running_jobs,
);

/// Engine-only behaviour.
mod engine {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stop_while_the_container_is_created_leaves_nothing() {
        crate::cases::setup();
        crate::cases::stop_while_the_container_is_created_leaves_nothing("podman").await;
    }
}

/// Backend-independent node behaviour, once on bwrap.
mod node {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failed_recording_returns_the_queue_slot() {
        crate::cases::setup();
        crate::cases::failed_recording_returns_the_queue_slot("bwrap").await;
    }
}

/// Every `BackendKind` the worker has runs the contract suite: the list in `all.rs` names a
/// backend of each kind (a new kind fails here until it is added there).
#[test]
fn every_backend_kind_is_in_the_list() {
    use clap::ValueEnum;
    use cynode_worker::config::BackendKind;
    let listed: Vec<&str> = crate::SHARED_BACKENDS
        .iter()
        .chain(crate::CONTRACT_ONLY_BACKENDS)
        .map(|b| crate::harness::node_backend(b))
        .collect();
    let kinds = BackendKind::value_variants();
    assert!(kinds.len() >= 4, "{kinds:?}");
    let missing: Vec<&str> = kinds
        .iter()
        .map(|k| k.as_str())
        .filter(|k| !listed.contains(k))
        .collect();
    assert!(
        missing.is_empty(),
        "backend kinds the contract suite does not run on: {missing:?} (add them to backend_list! in worker/tests/all.rs)"
    );
}
