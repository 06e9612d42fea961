//! The backend registry: each backend module exports one [`Descriptor`] (its kind, how it
//! is built from the config, whether its sandboxes can be gated, how messages name it, and
//! what a graceful stop must undo; the type is the parent module's, so a backend names
//! only its parent), and [`BACKENDS`] is the one table of them. Everything
//! outside `backend/` asks this module (or the [`SandboxBackend`] it built) and names no
//! backend itself.
//!
//! Adding a backend: its module with a `DESCRIPTOR`, one line in [`BACKENDS`], its
//! [`BackendKind`] variant and config section (`config`), and its ARCHITECTURE.md entry.
//! The fake backend ([`super::fake`], tests only) is registered exactly so.

use std::path::Path;
use std::sync::Arc;

use super::{Descriptor, SandboxBackend};
use crate::config::{BackendKind, Config};

/// Every backend the node can be configured with, in [`BackendKind`]'s order. The fake
/// backend is in the table only in the worker's own unit tests.
pub const BACKENDS: &[Descriptor] = &[
    super::engine::PODMAN,
    super::engine::DOCKER,
    super::bwrap::DESCRIPTOR,
    super::microvm::DESCRIPTOR,
    #[cfg(test)]
    super::fake::DESCRIPTOR,
];

/// The descriptor of `kind`: [`BACKENDS`] lists the kinds in their declared order, so a
/// kind's discriminant is its line (checked by a test).
pub fn descriptor(kind: BackendKind) -> &'static Descriptor {
    &BACKENDS[kind as usize]
}

/// The backend the config names: the one place a [`BackendKind`] becomes an
/// implementation.
pub fn from_config(cfg: &Config) -> Arc<dyn SandboxBackend> {
    super::record_node_pid();
    (descriptor(cfg.backend).build)(cfg)
}

/// Whether sandboxes of `cfg`'s backend can be started gated ([`Descriptor::can_gate`]).
pub fn can_gate(cfg: &Config) -> bool {
    (descriptor(cfg.backend).can_gate)(cfg)
}

/// `cfg`'s backend as messages name it ([`Descriptor::describe`]).
pub fn describe(cfg: &Config) -> String {
    (descriptor(cfg.backend).describe)(cfg)
}

/// A graceful stop's clean-up of every backend ([`Descriptor::shutdown`]). Blocking.
pub fn shutdown(state_dir: &Path) {
    for d in BACKENDS {
        (d.shutdown)(state_dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn every_kind_has_exactly_one_descriptor() {
        for kind in BackendKind::value_variants() {
            let n = BACKENDS.iter().filter(|d| d.kind == *kind).count();
            assert_eq!(n, 1, "{kind:?} has {n} descriptors in BACKENDS");
            assert_eq!(
                descriptor(*kind).kind,
                *kind,
                "BACKENDS is in BackendKind's order"
            );
        }
        assert_eq!(BACKENDS.len(), BackendKind::value_variants().len());
    }

    #[test]
    fn gating_follows_each_backends_own_answer() {
        let mut cfg = Config::default();
        for (kind, gates) in [
            (BackendKind::Bwrap, true),
            (BackendKind::Podman, true),
            (BackendKind::Docker, true),
            (BackendKind::Microvm, false),
            (BackendKind::Fake, false),
        ] {
            cfg.backend = kind;
            assert_eq!(can_gate(&cfg), gates, "{kind:?}");
            assert_eq!(describe(&cfg), kind.as_str());
        }
        cfg.backend = BackendKind::Podman;
        cfg.podman.runtime = crate::config::OciRuntime::Runsc;
        assert!(!can_gate(&cfg));
        assert_eq!(describe(&cfg), "podman with gVisor");
    }
}
