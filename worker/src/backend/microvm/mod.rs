//! The microvm backend: every job in its own KVM virtual machine with its own kernel, so a
//! job's kernel exploit ends in a guest that holds nothing but that job.
//!
//! A VM ([`vm`]) is QEMU's `microvm` machine booting the minimal guest kernel that
//! `deploy/microvm/build-kernel.sh` builds from Debian's linux-source, with the image's
//! root filesystem as a read-only squashfs the node makes ([`rootfs`]) and
//! `cynode-vminit` as PID 1. The guest has no network device; `/job` and `/workspace` come
//! from one 9p share; stdout, stderr and the control messages travel over virtio-serial.
//! Inside, the job runs as uid 1000 with no-new-privileges, the node's seccomp programs,
//! and a cgroup with the memory and pids limits; the VM itself has the job's vCPUs
//! (`limits.cpus`, rounded up) and its memory plus `microvm.memory_overhead_mb`.
//!
//! The warm pool ([`pool`]) keeps `microvm.pool_size` booted VMs per image; each serves
//! one job and is destroyed. Timeouts and cancellation SIGKILL QEMU's process group.
//!
//! Not available on this backend yet: the per-job unix sockets in `/job` (the SBA's
//! lifecycle `status.sock` and the inference proxy's `inference.sock`) do not cross the VM
//! boundary, and `network_policy: restricted|allow` has no egress path (the guest has no
//! network device at all, so such jobs run without network).

pub mod pool;
pub mod rootfs;
pub use crate::config::microvm as settings;
pub mod vm;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cynode_vminit::{GuestMsg, JobSpec, ShareMount};
use tokio_util::sync::CancellationToken;

use super::bwrap::IsolatedBwrap;
use super::{
    capture, BackendError, EndReason, IsolatedError, IsolatedOutput, IsolatedRun, PerCommand,
    ResourceLimits, SandboxBackend, SandboxOutcome, SandboxSpec, SessionSandbox,
};
use crate::config::BackendKind;
use crate::sandbox::SANDBOX_UID;
pub use settings::MicrovmConfig;

/// How long a guest may take to power off after it reported its job's end.
const POWER_OFF_BOUND: Duration = Duration::from_secs(2);

/// The microvm backend.
#[derive(Debug, Clone)]
pub struct MicrovmBackend {
    /// The settings, `accel` resolved for this host.
    cfg: MicrovmConfig,
    /// Why that accelerator.
    accel_why: &'static str,
    /// Image → root filesystem directory (`microvm.rootfs`, then `bwrap.rootfs`).
    rootfs: BTreeMap<String, PathBuf>,
    /// The node's limits, which pooled VMs are booted with.
    limits: ResourceLimits,
    dir: PathBuf,
    pool: pool::Pool,
    /// Isolated runs (the changeset's git) go to the node's bubblewrap.
    tools: IsolatedBwrap,
}

/// vCPUs for a CPU limit: rounded up, at least one, at most the host's.
fn vcpus(cpus: f64) -> u32 {
    let host = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let want = if cpus.is_finite() && cpus > 0.0 {
        cpus.ceil() as u32
    } else {
        host
    };
    want.clamp(1, host.max(1))
}

/// The kernel version a guest kernel names: an ELF vmlinux's `Linux version` banner, or a
/// bzImage's setup header.
pub fn kernel_version(path: &Path) -> Option<String> {
    let bytes = std::fs::read(path).ok()?;
    if bytes.starts_with(b"\x7fELF") {
        const BANNER: &[u8] = b"Linux version ";
        let at = bytes.windows(BANNER.len()).position(|w| w == BANNER)? + BANNER.len();
        let tail = bytes.get(at..(at + 64).min(bytes.len()))?;
        let end = tail.iter().position(|b| *b == b' ' || *b == 0)?;
        return Some(String::from_utf8_lossy(&tail[..end]).into_owned());
    }
    // setup header: "HdrS" at 0x202, kernel_version (offset from 0x200) at 0x20e.
    if bytes.get(0x202..0x206)? != b"HdrS" {
        return None;
    }
    let off = u16::from_le_bytes([*bytes.get(0x20e)?, *bytes.get(0x20f)?]) as usize + 0x200;
    let tail = bytes.get(off..(off + 128).min(bytes.len()))?;
    let end = tail.iter().position(|b| *b == 0)?;
    Some(String::from_utf8_lossy(&tail[..end]).into_owned())
}

impl MicrovmBackend {
    /// A backend with `cfg`; `bwrap_rootfs` serves images `cfg.rootfs` does not list.
    pub fn new(
        cfg: MicrovmConfig,
        bwrap_rootfs: &BTreeMap<String, PathBuf>,
        limits: ResourceLimits,
        state_dir: &Path,
        tools: IsolatedBwrap,
    ) -> Self {
        let mut rootfs = bwrap_rootfs.clone();
        rootfs.extend(cfg.rootfs.clone());
        let mut cfg = cfg;
        let (accel, accel_why) = cfg.accel.resolve();
        cfg.accel = accel;
        let dir = state_dir.join("microvm");
        let pool = pool::Pool::new(cfg.pool_size, dir.join("vms"));
        Self {
            cfg,
            accel_why,
            rootfs,
            limits,
            dir,
            pool,
            tools,
        }
    }

    /// The root filesystem directory of `image`.
    pub fn rootfs_for(&self, image: &str) -> Option<&Path> {
        self.rootfs
            .get(image)
            .map(PathBuf::as_path)
            .filter(|p| p.is_dir())
    }

    /// The launch template for `image` with `limits`.
    async fn template(&self, image: &str, limits: ResourceLimits) -> Result<vm::Launch, String> {
        let dir = self
            .rootfs_for(image)
            .ok_or_else(|| format!("no root filesystem configured for image `{image}`"))?;
        let rootfs = rootfs::squashfs_for(
            &self.cfg.mksquashfs,
            dir,
            &self.cfg.init,
            &self.dir.join("rootfs"),
        )
        .await
        .map_err(|e| e.to_string())?;
        Ok(vm::Launch {
            qemu: self.cfg.qemu.clone(),
            accel: self.cfg.accel,
            cpu: self.cfg.cpu.clone(),
            kernel: self.cfg.kernel.clone(),
            rootfs,
            memory_mb: limits.memory_mb + self.cfg.memory_overhead_mb,
            vcpus: vcpus(limits.cpus),
            kernel_args: self.cfg.kernel_args.clone(),
            boot_timeout: Duration::from_secs(self.cfg.boot_timeout_seconds.max(1)),
            dir: PathBuf::new(),
            limits,
        })
    }

    /// Starts filling the pool for every image with a root filesystem.
    pub async fn prewarm(&self) {
        if self.pool.size() == 0 {
            return;
        }
        let images: Vec<String> = self.rootfs.keys().cloned().collect();
        for image in images {
            match self.template(&image, self.limits).await {
                Ok(t) => self.pool.refill(&image, &t),
                Err(e) => tracing::warn!(image, error = %e, "microvm pool not filled"),
            }
        }
    }

    /// The pool (benchmarks and `check`).
    pub fn pool(&self) -> &pool::Pool {
        &self.pool
    }
}

/// The microVM's entry in the backend registry ([`super::BACKENDS`]): it cannot gate (the
/// guest's network is its own), and a stop leaves its pool to end with the node.
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    kind: BackendKind::Microvm,
    build: |cfg| {
        std::sync::Arc::new(MicrovmBackend::new(
            cfg.microvm.clone(),
            &cfg.bwrap.rootfs,
            ResourceLimits::from_limits(&cfg.limits),
            &cfg.state_dir,
            IsolatedBwrap::for_config(cfg),
        ))
    },
    can_gate: |_| false,
    describe: super::kind_name,
    shutdown: |_| {},
};

#[async_trait::async_trait]
impl SandboxBackend for MicrovmBackend {
    /// The guest's init runs each command with no stdin and takes no signals for it.
    fn exec_io(&self) -> bool {
        false
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Microvm
    }

    /// KVM, the kernel, the init, the VMM, mksquashfs and the pool.
    async fn check(&self) -> Result<String, BackendError> {
        let kvm = match (kvm_api_version(), self.cfg.accel) {
            (Ok(v), _) => format!("KVM API {v}"),
            (Err(e), settings::Accel::Tcg) => format!("no KVM ({e})"),
            (Err(e), _) => {
                return Err(BackendError::Unavailable(format!(
                    "/dev/kvm not usable: {e}"
                )))
            }
        };
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(BackendError::Unavailable(
                "microvm needs root: it bind-mounts the job's directories into the VM's share and starts QEMU as uid 1000".into(),
            ));
        }
        if self.cfg.accel == settings::Accel::Kvm && vm_group_missing() {
            return Err(BackendError::Unavailable(
                "/dev/kvm is not group read-write (QEMU runs as uid 1000 with its group): run deploy/microvm/build-kernel.sh".into(),
            ));
        }
        let kernel = kernel_version(&self.cfg.kernel).ok_or_else(|| {
            BackendError::Unavailable(format!(
                "no guest kernel at {} (deploy/microvm/build-kernel.sh builds it)",
                self.cfg.kernel.display()
            ))
        })?;
        if !self.cfg.init.is_file() {
            return Err(BackendError::Unavailable(format!(
                "no guest init at {} (deploy/microvm/build-init.sh builds it)",
                self.cfg.init.display()
            )));
        }
        let out = super::client_env(&mut tokio::process::Command::new(&self.cfg.qemu))
            .arg("--version")
            .output()
            .await
            .map_err(|e| BackendError::Client(format!("{} not runnable: {e}", self.cfg.qemu)))?;
        let qemu = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        let squash = rootfs::mksquashfs_version(&self.cfg.mksquashfs)
            .await
            .ok_or_else(|| {
                BackendError::Unavailable(format!("{} not runnable", self.cfg.mksquashfs))
            })?;
        seccomp_hex().map_err(BackendError::Unavailable)?;
        Ok(format!(
            "{kvm}, accel {} ({}), kernel {}, {qemu}, {squash}, pool {} idle of {} per image",
            self.cfg.accel.as_str(),
            self.accel_why,
            kernel.split_whitespace().next().unwrap_or(&kernel),
            self.pool.idle(),
            self.pool.size()
        ))
    }

    async fn has_image(&self, image: &str) -> bool {
        self.rootfs_for(image).is_some()
    }

    /// Runs one job in a VM of its own; the VM is gone when this returns.
    async fn run(&self, spec: &SandboxSpec, cancel: &CancellationToken) -> SandboxOutcome {
        let started = Instant::now();
        let fail = |msg: String| SandboxOutcome::start_failed(msg, started);
        let template = match self.template(&spec.image, spec.limits).await {
            Ok(t) => t,
            Err(e) => return fail(e),
        };
        let mut mounts = Vec::new();
        let mut shares = Vec::new();
        for m in &spec.mounts {
            let Some(name) = vm::SHARE_DIRS
                .iter()
                .find(|n| m.target.trim_start_matches('/') == **n)
            else {
                return fail(format!("microvm cannot mount {}", m.target));
            };
            mounts.push((m.host.clone(), *name, m.writable));
            shares.push(ShareMount {
                source: name.to_string(),
                target: m.target.clone(),
                writable: m.writable,
            });
        }
        let seccomp = match seccomp_hex() {
            Ok(s) => s,
            Err(e) => return fail(e),
        };
        let mut argv = Vec::new();
        if !spec.override_entrypoint {
            argv.push(super::bwrap::SBA_ENTRYPOINT.to_string());
        }
        argv.extend(spec.command.iter().cloned());
        let job = JobSpec {
            argv,
            env: spec.env.clone(),
            workdir: spec.workdir.clone(),
            mounts: shares,
            uid: SANDBOX_UID,
            memory_mb: spec.limits.memory_mb,
            pids: spec.limits.pids,
            tmpfs_mb: spec.limits.tmpfs_mb,
            seccomp,
        };
        let (mut vm, warm) = tokio::select! {
            r = self.pool.claim(&spec.image, &template) => match r {
                Ok(v) => v,
                Err(e) => return fail(e.to_string()),
            },
            _ = cancel.cancelled() => return fail("canceled".into()),
        };
        if let Err(e) = vm.claim(&mounts, spec.host_uid, &job).await {
            return fail(e.to_string());
        }
        let out = capture::spawn_stdout(vm.out.take(), spec.output_cap);
        let err = capture::spawn_stderr(vm.err.take(), spec.output_cap);
        let deadline = tokio::time::Instant::now() + spec.timeout;
        let mut end = None;
        let mut exit_code = None;
        let mut failure = None;
        let mut job_started = None;
        while end.is_none() {
            tokio::select! {
                msg = vm.next_msg() => match msg {
                    Some(GuestMsg::Started) => {
                        job_started = Some(started.elapsed());
                    }
                    Some(GuestMsg::Ready) => {}
                    Some(GuestMsg::Exited { code }) => {
                        exit_code = Some(code);
                        end = Some(EndReason::Exited);
                    }
                    Some(GuestMsg::Failed { message }) => {
                        failure = Some(format!("the guest could not start the job: {message}"));
                    }
                    None => {
                        // The port closed: the guest reset (a panic, a triple fault) or QEMU died.
                        let text = vm.console_tail().await;
                        let msg = failure.take().unwrap_or_else(|| {
                            format!("the microvm ended without reporting an exit{text}")
                        });
                        end = Some(EndReason::StartFailed(msg));
                    }
                },
                _ = tokio::time::sleep_until(deadline) => end = Some(EndReason::TimedOut),
                _ = cancel.cancelled() => end = Some(EndReason::Canceled),
            }
        }
        let end = end.unwrap_or(EndReason::Exited);
        if end == EndReason::Exited {
            vm.finish(POWER_OFF_BOUND).await;
        } else {
            vm.kill().await;
        }
        tracing::info!(
            name = %spec.name,
            warm,
            boot_ms = vm.boot.as_millis() as u64,
            to_job_ms = job_started.map(|d| d.as_millis() as u64),
            "microvm job ended"
        );
        let outcome = SandboxOutcome::collected(exit_code, out, err, end, started).await;
        // Unmounts and removes the VM's directory.
        drop(vm);
        outcome
    }

    /// Kills leftover VMs of a previous run (their QEMU died with the node), unmounts
    /// their shares, removes their directories, then starts filling the pool.
    async fn remove_all_managed(&self) -> usize {
        let vms = self.dir.join("vms");
        let mut removed = 0;
        if let Ok(entries) = std::fs::read_dir(&vms) {
            for e in entries.flatten() {
                let path = e.path();
                for s in vm::SHARE_DIRS {
                    vm::unmount(&path.join("share").join(s));
                }
                vm::remove_dir(Some(&path));
                removed += 1;
            }
        }
        let _ = std::fs::create_dir_all(&vms);
        // QEMU (uid 1000) needs to traverse to its VM's directory.
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o755));
        let _ = std::fs::set_permissions(&vms, std::fs::Permissions::from_mode(0o755));
        self.prewarm().await;
        removed
    }

    /// A VM's QEMU dies with its run; leftovers are [`SandboxBackend::remove_all_managed`]'s.
    async fn remove_named(&self, _name: &str) {}

    /// Each command of a session runs in a VM of its own over the same workspace
    /// ([`PerCommand`], as on bubblewrap).
    async fn start_session(
        &self,
        _spec: &SandboxSpec,
    ) -> Result<Arc<dyn SessionSandbox>, BackendError> {
        Ok(Arc::new(PerCommand(self.clone())))
    }

    /// In the node's bubblewrap, as on every backend.
    async fn run_isolated(&self, run: IsolatedRun) -> Result<IsolatedOutput, IsolatedError> {
        self.tools.run(run).await
    }
}

/// The node's seccomp programs ([`super::seccomp::bpf_programs`]) in hex, built once: the
/// guest init installs them before it executes the job.
fn seccomp_hex() -> Result<Vec<String>, String> {
    static HEX: std::sync::OnceLock<Result<Vec<String>, String>> = std::sync::OnceLock::new();
    HEX.get_or_init(|| {
        super::seccomp::bpf_programs()
            .map(|p| p.iter().map(hex::encode).collect())
            .map_err(|e| e.to_string())
    })
    .clone()
}

/// `KVM_GET_API_VERSION` on `/dev/kvm`.
fn kvm_api_version() -> std::io::Result<i32> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")?;
    const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;
    // SAFETY: an ioctl without arguments on an open /dev/kvm fd.
    let v = unsafe { libc::ioctl(f.as_raw_fd(), KVM_GET_API_VERSION, 0) };
    if v < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v)
}

/// Whether `/dev/kvm` lacks group read-write (QEMU as uid 1000 could not open it).
fn vm_group_missing() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/dev/kvm").map_or(true, |m| m.mode() & 0o060 != 0o060)
}
