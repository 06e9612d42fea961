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
    /// `kvm` where `/dev/kvm` can run an unmodified guest kernel, else `tcg`
    /// ([`Accel::resolve`]).
    Auto,
    Kvm,
    Tcg,
}

/// Present when the host's KVM is PVM (pagetable-based virtualisation without hardware
/// support, used for nested guests in cloud VMs): it runs only PVM-enabled guest kernels,
/// and an unmodified one stops with "emulation failure" at its first `xrstor` or `int3`.
pub const PVM_MODULE: &str = "/sys/module/kvm_pvm";

impl Accel {
    /// The name QEMU's `-accel` takes (`auto` resolves first).
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Auto => "auto",
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }

    /// `Auto` made concrete for this host: `kvm` when `/dev/kvm` opens read-write and the
    /// host's KVM is not PVM, `tcg` otherwise. The reason goes with it, for `check`.
    pub fn resolve(self) -> (Accel, &'static str) {
        match self {
            Accel::Auto => {
                if std::path::Path::new(PVM_MODULE).exists() {
                    (
                        Accel::Tcg,
                        "auto: this host's KVM is PVM, which cannot run an unmodified guest kernel",
                    )
                } else if std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open("/dev/kvm")
                    .is_ok()
                {
                    (Accel::Kvm, "auto")
                } else {
                    (Accel::Tcg, "auto: /dev/kvm is not usable")
                }
            }
            a => (a, "configured"),
        }
    }
}

/// The microvm backend's settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MicrovmConfig {
    /// The VMM: QEMU with the `microvm` machine type.
    pub qemu: String,
    /// QEMU's accelerator: `kvm` (hardware virtualisation through `/dev/kvm`), `tcg`
    /// (QEMU's own CPU emulation: still a kernel of its own per job, behind QEMU instead
    /// of KVM, many times slower), or `auto` (the default: see [`Accel::resolve`]).
    pub accel: Accel,
    /// QEMU's `-cpu`; empty: `host,-arch-capabilities` with kvm, `qemu64` with tcg.
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
    /// Guest memory above the job's `limits.memory_mb` (its kernel, init, page cache,
    /// tmpfs): default 128. With 64, a guest for a 64 MiB job (128 MiB in all) crashed its
    /// init during boot now and then under TCG.
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
            accel: Accel::Auto,
            cpu: String::new(),
            kernel: PathBuf::from(DEFAULT_CACHE).join("vmlinux"),
            init: PathBuf::from(DEFAULT_CACHE).join("cynode-vminit"),
            mksquashfs: "mksquashfs".into(),
            rootfs: BTreeMap::new(),
            pool_size: 2,
            memory_overhead_mb: 128,
            boot_timeout_seconds: 20,
            kernel_args: Vec::new(),
        }
    }
}
