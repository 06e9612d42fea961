//! cynode-worker: the Worker API node (design.md §3.4).
//!
//! Not built yet: this crate is filled by the worker issue. It deliberately exports nothing,
//! so nothing can depend on a worker that does not exist.
