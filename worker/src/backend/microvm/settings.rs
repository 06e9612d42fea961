//! `microvm:` in the node's config: where the guest kernel, the guest init and the VMM
//! are, the root filesystems, the warm pool's size and the guest's boot bound. Every field
//! has a default that works after `deploy/install-deps.sh` and `deploy/test-env.sh`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Where deploy/microvm/build-kernel.sh and build-init.sh leave their outputs.
pub const DEFAULT_CACHE: &str = "/var/cache/cynode/microvm";

/// QEMU's accelerator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    /// The name QEMU's `-accel` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// The microvm backend's settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MicrovmConfig {
    /// The VMM: QEMU with the `microvm` machine type.
    pub qemu: String,
    /// QEMU's accelerator: `kvm` (hardware virtualisation through `/dev/kvm`) or `tcg`
    /// (QEMU's own CPU emulation: still a kernel of its own per job, behind QEMU instead
    /// of KVM; for hosts whose `/dev/kvm` cannot run an unmodified guest).
    pub accel: Accel,
    /// QEMU's `-cpu`; empty: `host,-arch-capabilities` with kvm, `max` with tcg.
    pub cpu: String,
    /// The guest kernel: the uncompressed ELF (booted through its PVH entry) or a bzImage.
    pub kernel: PathBuf,
    /// The guest's PID 1 (`cynode-vminit`, static), injected into every root filesystem.
    pub init: PathBuf,
    /// `mksquashfs`, which makes the read-only root filesystem from an image's directory.
    pub mksquashfs: String,
    /// Image name → root filesystem directory. Images not listed here use `bwrap.rootfs`.
    pub rootfs: BTreeMap<String, PathBuf>,
    /// Booted VMs kept waiting per image (each used once, then destroyed). 0: every job
    /// boots its own VM when it starts.
    pub pool_size: usize,
    /// Guest memory above the job's `limits.memory_mb` (its kernel, init, page cache).
    pub memory_overhead_mb: u64,
    /// Bound on a boot, from starting QEMU to the guest's ready message.
    pub boot_timeout_seconds: u64,
    /// Extra guest kernel parameters (e.g. `sysctl.vm.panic_on_oom=1`).
    pub kernel_args: Vec<String>,
}

impl Default for MicrovmConfig {
    fn default() -> Self {
        Self {
            qemu: "qemu-system-x86_64".into(),
            accel: Accel::Kvm,
            cpu: String::new(),
            kernel: PathBuf::from(DEFAULT_CACHE).join("vmlinux"),
            init: PathBuf::from(DEFAULT_CACHE).join("cynode-vminit"),
            mksquashfs: "mksquashfs".into(),
            rootfs: BTreeMap::new(),
            pool_size: 2,
            memory_overhead_mb: 64,
            boot_timeout_seconds: 20,
            kernel_args: Vec::new(),
        }
    }
}
