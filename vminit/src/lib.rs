//! The microvm backend's guest side and its wire protocol. `cynode-vminit` is PID 1 of
//! every guest: the node injects it into the job image's read-only root filesystem
//! (squashfs) and boots the kernel with `init=` pointing at it.
//!
//! The node and the guest talk over three virtio-serial ports (no network device):
//! - [`CTL_PORT`]: one JSON object a line. The guest says [`GuestMsg::Ready`] once it has
//!   booted; the node answers with one [`JobSpec`] (the moment a warm VM is claimed); the
//!   guest says [`GuestMsg::Started`] when the job runs, then [`GuestMsg::Exited`] or
//!   [`GuestMsg::Failed`], and reboots (which ends QEMU, started with `-no-reboot`).
//! - [`OUT_PORT`], [`ERR_PORT`]: the job's stdout and stderr, raw bytes.
//!
//! The job's `/job` and `/workspace` are sub-directories of one 9p share ([`SHARE_TAG`]),
//! mounted only after the claim: the node bind-mounts the job's real directories into
//! that share's staging directory just before it sends the spec.

pub mod guest;

use serde::{Deserialize, Serialize};

/// The control port's virtio-serial name (`virtserialport,name=…`); the guest finds its
/// device under `/sys/class/virtio-ports/*/name`.
pub const CTL_PORT: &str = "cynode.ctl";
/// The job's stdout port.
pub const OUT_PORT: &str = "cynode.out";
/// The job's stderr port.
pub const ERR_PORT: &str = "cynode.err";
/// The 9p mount tag of the share that holds `job/` and `workspace/`.
pub const SHARE_TAG: &str = "cynode";
/// Where the guest mounts that share before it bind-mounts its sub-directories.
pub const SHARE_MOUNT: &str = "/mnt/cynode";
/// Directories the root filesystem must have as mount points (the node adds them to the
/// squashfs it makes from the image).
pub const MOUNT_POINTS: &[&str] = &[
    "/proc",
    "/sys",
    "/dev",
    "/tmp",
    "/run",
    "/mnt",
    SHARE_MOUNT,
    "/job",
    "/workspace",
];
/// Where the node puts this program in the root filesystem.
pub const INIT_PATH: &str = "/.cynode-vminit";
/// Bound on one control line (the spec carries the job's env and argv).
pub const MAX_LINE: usize = 4 * 1024 * 1024;

/// What the guest tells the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum GuestMsg {
    /// Booted, waiting for a job.
    Ready,
    /// The job's process runs.
    Started,
    /// The job's process ended: its exit code, or 128 + the signal that ended it.
    Exited { code: i32 },
    /// The guest could not set the job up.
    Failed { message: String },
}

/// One of the share's sub-directories, mounted at `target`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareMount {
    /// A plain name under [`SHARE_MOUNT`] (`job`, `workspace`).
    pub source: String,
    pub target: String,
    pub writable: bool,
}

/// The job the node hands a booted guest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    /// Program and arguments (looked up in the job's `PATH`).
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub workdir: String,
    pub mounts: Vec<ShareMount>,
    /// The uid and gid the job runs as.
    pub uid: u32,
    /// The job's cgroup limits inside the guest (`memory.max`, `pids.max`).
    pub memory_mb: u64,
    pub pids: u64,
    /// Size of the tmpfs at `/tmp`.
    pub tmpfs_mb: u64,
    /// seccomp programs (hex of the `struct sock_filter` arrays) installed before exec.
    pub seccomp: Vec<String>,
}
