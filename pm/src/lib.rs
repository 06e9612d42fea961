//! cynode-pm: the project-manager control plane (design.md §1, §3.5).
//!
//! Not built yet: this crate is filled by the PM issues. It deliberately exports nothing,
//! so nothing can depend on a PM that does not exist.
