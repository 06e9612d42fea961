//! cynode-pm: the project-manager control plane (design.md §1, §3.5).
//!
//! Built so far: the deterministic half between "the model chose skill X with inputs Y"
//! and "this job.json may be dispatched".
//! - [`skills`]: skill packages, their registry, and the deterministic job builder.
//! - [`policy`]: the policy gate (Rego in-process with regorus, or an external OPA).
//! - [`cli`]: `cynode-pm skills …` and `cynode-pm policy check`.

pub mod cli;
pub mod policy;
pub mod skills;
