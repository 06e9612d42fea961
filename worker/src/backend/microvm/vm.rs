//! One QEMU microVM: booted to the guest init's ready message, then given exactly one job,
//! then destroyed. Nothing of a VM is reused.
//!
//! QEMU runs as the sandbox user (uid/gid 1000, with only the group of `/dev/kvm` besides)
//! in its own process group, dies with the node, and confines itself with its own seccomp
//! sandbox (`-sandbox on` with obsolete calls, privilege changes, spawning and resource
//! control denied). The machine is `-M microvm` without ACPI, PIC, PIT, RTC, ISA serial or
//! option ROMs, `-nodefaults -no-user-config`, and has exactly these devices, all virtio
//! over MMIO: the read-only root (a raw squashfs, `readonly=on`), one 9p share served by
//! QEMU from the VM's staging directory, and one virtio-serial device with the console and
//! three ports (control, stdout, stderr), each a unix socket in the VM's directory that
//! only the node connects to. No network device exists.
//!
//! The job's directories reach the guest by bind mounts the node makes, at the claim, onto
//! the staging directory's `job/` and `workspace/`; QEMU opened the staging directory when
//! it started and walks into them by name, so it sees the mounts. They are unmounted once
//! QEMU is dead, before the staging directories are removed (by `rmdir` only: nothing is
//! ever deleted recursively through a mount).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use cynode_vminit::{GuestMsg, JobSpec, MAX_LINE, SHARE_TAG};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::process::{Child, Command};

use crate::backend::{capture, ResourceLimits};
use crate::sandbox::SANDBOX_UID;

/// Cap on the guest console kept for diagnostics.
const CONSOLE_CAP: usize = 64 * 1024;
/// The staging sub-directories a job's mounts may use.
pub const SHARE_DIRS: [&str; 2] = ["job", "workspace"];

/// How to start a VM.
#[derive(Debug, Clone)]
pub struct Launch {
    pub qemu: String,
    pub accel: super::settings::Accel,
    pub cpu: String,
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
    /// Guest RAM.
    pub memory_mb: u64,
    pub vcpus: u32,
    pub kernel_args: Vec<String>,
    pub boot_timeout: Duration,
    /// The VM's own directory (created here, removed when the VM is dropped).
    pub dir: PathBuf,
    /// The limits the VM's job will get (a pooled VM serves only jobs with these).
    pub limits: ResourceLimits,
}

/// Why a VM could not be booted or given its job.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{0}")]
    Setup(String),
    #[error("the guest did not boot: {0}")]
    Boot(String),
    #[error("cannot hand the job to the guest: {0}")]
    Claim(String),
}

/// A booted VM waiting for (or running) its one job.
pub struct Vm {
    pub dir: PathBuf,
    pub limits: ResourceLimits,
    /// Start of QEMU to the guest's ready message.
    pub boot: Duration,
    child: Child,
    pgid: Option<i32>,
    ctl_r: BufReader<OwnedReadHalf>,
    ctl_w: OwnedWriteHalf,
    pub out: Option<UnixStream>,
    pub err: Option<UnixStream>,
    console: Option<capture::Pending>,
    qemu_err: Option<capture::Pending>,
    mounted: Vec<PathBuf>,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm").field("dir", &self.dir).finish()
    }
}

fn setup(what: &str, path: &Path, e: std::io::Error) -> VmError {
    VmError::Setup(format!("{what} {}: {e}", path.display()))
}

/// A directory owned by the sandbox user (QEMU runs as it).
fn owned_dir(path: &Path, mode: u32) -> Result<(), VmError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir(path).map_err(|e| setup("mkdir", path, e))?;
    std::os::unix::fs::chown(path, Some(SANDBOX_UID), Some(SANDBOX_UID))
        .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)))
        .map_err(|e| setup("chown", path, e))
}

/// The group that may open `/dev/kvm`, when the device is group read-write.
fn kvm_group() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata("/dev/kvm").ok()?;
    (m.mode() & 0o060 == 0o060).then_some(m.gid())
}

impl Launch {
    /// QEMU's argv.
    pub fn args(&self) -> Vec<String> {
        let d = |name: &str| self.dir.join(name).display().to_string();
        let mut cmdline = [
            "console=hvc0",
            "root=/dev/vda",
            "rootfstype=squashfs",
            "ro",
            // Warnings and the registers of a process killed by a signal reach the
            // console (`quiet` would hide both); info-level boot messages do not.
            "loglevel=5",
            "reboot=t",
            "panic=-1",
            "nokaslr",
            "tsc=reliable",
            "no_timer_check",
            "i8042.noaux",
            "cryptomgr.notests",
            // A process killed by a signal (the guest's init, say) is reported on the
            // console with its registers, which a failed boot's reason carries.
            "print-fatal-signals=1",
        ]
        .map(String::from)
        .to_vec();
        cmdline.push(format!("init={}", cynode_vminit::INIT_PATH));
        cmdline.extend(self.kernel_args.iter().cloned());
        // With KVM the guest has kvm-clock, so the legacy timers can go; TCG needs the PIT
        // to calibrate its clock.
        use super::settings::Accel;
        let machine = match self.accel {
            Accel::Kvm | Accel::Auto => {
                "microvm,x-option-roms=off,pit=off,pic=off,isa-serial=off,rtc=off,acpi=off"
            }
            Accel::Tcg => "microvm,x-option-roms=off,isa-serial=off,acpi=off",
        };
        let cpu = match (self.cpu.is_empty(), self.accel) {
            (false, _) => self.cpu.clone(),
            (true, Accel::Kvm | Accel::Auto) => "host,-arch-capabilities".into(),
            // A baseline CPU: QEMU 7.2's TCG `max` advertises AVX2, whose fresh emulation
            // crashed glibc's string functions in the guest now and then.
            (true, Accel::Tcg) => "qemu64".into(),
        };
        let mut a: Vec<String> = vec![
            "-M".into(),
            machine.into(),
            "-accel".into(),
            match self.accel {
                // TCG's translation cache defaults to 1 GiB per VM; 64 MiB bounds its RSS.
                Accel::Tcg => "tcg,tb-size=64".into(),
                Accel::Kvm | Accel::Auto => "kvm".into(),
            },
            "-cpu".into(),
            cpu,
        ];
        a.extend(
            [
                "-nodefaults",
                "-no-user-config",
                "-nographic",
                "-no-reboot",
                "-sandbox",
                "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
            ]
            .map(String::from),
        );
        a.extend(["-m".into(), format!("{}M", self.memory_mb)]);
        a.extend(["-smp".into(), self.vcpus.to_string()]);
        a.extend(["-kernel".into(), self.kernel.display().to_string()]);
        a.extend(["-append".into(), cmdline.join(" ")]);
        a.extend([
            "-drive".into(),
            format!(
                "id=root,file={},format=raw,if=none,readonly=on",
                self.rootfs.display()
            ),
            "-device".into(),
            "virtio-blk-device,drive=root".into(),
            "-fsdev".into(),
            format!("local,id=share,path={},security_model=none", d("share")),
            "-device".into(),
            format!("virtio-9p-device,fsdev=share,mount_tag={SHARE_TAG}"),
            "-device".into(),
            "virtio-serial-device,max_ports=4".into(),
            "-chardev".into(),
            "stdio,id=con,signal=off".into(),
            "-device".into(),
            "virtconsole,chardev=con,nr=0".into(),
        ]);
        for (nr, name) in [(1, "ctl"), (2, "out"), (3, "err")] {
            a.extend([
                "-chardev".into(),
                format!(
                    "socket,id={name},path={},server=on,wait=off",
                    d(&format!("{name}.sock"))
                ),
                "-device".into(),
                format!("virtserialport,chardev={name},nr={nr},name=cynode.{name}"),
            ]);
        }
        a
    }

    /// Starts QEMU and waits for the guest's ready message.
    pub async fn boot(self) -> Result<Vm, VmError> {
        let started = Instant::now();
        let deadline = started + self.boot_timeout;
        owned_dir(&self.dir, 0o700)?;
        let share = self.dir.join("share");
        owned_dir(&share, 0o755)?;
        for s in SHARE_DIRS {
            owned_dir(&share.join(s), 0o755)?;
        }
        let mut cmd = Command::new(&self.qemu);
        crate::backend::client_env(&mut cmd)
            .args(self.args())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        // SAFETY: geteuid has no preconditions.
        let as_root = unsafe { libc::geteuid() } == 0;
        let kvm = kvm_group();
        // SAFETY: between fork and exec only setgroups/setgid/setuid/prctl run, on values
        // computed before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if as_root {
                    let groups: Vec<libc::gid_t> = kvm.into_iter().collect();
                    if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                        || libc::setgid(SANDBOX_UID) != 0
                        || libc::setuid(SANDBOX_UID) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                crate::backend::die_with_node()
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| VmError::Setup(format!("cannot start {}: {e}", self.qemu)))?;
        let pgid = child.id().map(|p| p as i32);
        let console = capture::spawn(child.stdout.take(), CONSOLE_CAP);
        let qemu_err = capture::spawn(child.stderr.take(), CONSOLE_CAP);
        let mut vm_dir = Some(self.dir.clone());
        // From here a failure must still kill QEMU and clean the directory: a Vm owns them.
        let connect = async {
            let ctl = connect(&self.dir.join("ctl.sock"), deadline, &mut child).await?;
            let out = connect(&self.dir.join("out.sock"), deadline, &mut child).await?;
            let err = connect(&self.dir.join("err.sock"), deadline, &mut child).await?;
            Ok::<_, VmError>((ctl, out, err))
        }
        .await;
        let (ctl, out, err) = match connect {
            Ok(c) => c,
            Err(e) => {
                kill_group(pgid);
                let _ = child.wait().await;
                remove_dir(vm_dir.take().as_deref());
                let text = console_text(Some(console), Some(qemu_err)).await;
                return Err(VmError::Boot(format!("{e}{text}")));
            }
        };
        let (r, w) = ctl.into_split();
        let mut vm = Vm {
            dir: self.dir.clone(),
            limits: self.limits,
            boot: Duration::ZERO,
            child,
            pgid,
            ctl_r: BufReader::new(r),
            ctl_w: w,
            out: Some(out),
            err: Some(err),
            console: Some(console),
            qemu_err: Some(qemu_err),
            mounted: Vec::new(),
        };
        match tokio::time::timeout_at(deadline.into(), vm.next_msg()).await {
            Ok(Some(GuestMsg::Ready)) => {
                vm.boot = started.elapsed();
                Ok(vm)
            }
            Ok(other) => {
                let text = vm.console_tail().await;
                Err(VmError::Boot(format!("guest said {other:?}{text}")))
            }
            Err(_) => {
                let text = vm.console_tail().await;
                Err(VmError::Boot(format!(
                    "no ready message within {:?}{text}",
                    self.boot_timeout
                )))
            }
        }
    }
}

/// Connects to QEMU's chardev socket `path` once QEMU has made it.
async fn connect(path: &Path, deadline: Instant, child: &mut Child) -> Result<UnixStream, VmError> {
    loop {
        match UnixStream::connect(path).await {
            Ok(s) => return Ok(s),
            Err(e) => {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(VmError::Boot(format!("QEMU exited ({status})")));
                }
                if Instant::now() >= deadline {
                    return Err(VmError::Boot(format!("{}: {e}", path.display())));
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    }
}

fn kill_group(pgid: Option<i32>) {
    if let Some(pg) = pgid {
        // SAFETY: signalling the process group QEMU leads.
        unsafe {
            libc::kill(-pg, libc::SIGKILL);
        }
    }
}

/// Removes a VM directory's known entries with unlink/rmdir only: anything unexpected
/// (a mount still in place, a file someone made) makes `rmdir` fail and stays.
pub fn remove_dir(dir: Option<&Path>) {
    let Some(dir) = dir else { return };
    for s in ["ctl.sock", "out.sock", "err.sock"] {
        let _ = std::fs::remove_file(dir.join(s));
    }
    let share = dir.join("share");
    for s in SHARE_DIRS {
        let _ = std::fs::remove_dir(share.join(s));
    }
    let _ = std::fs::remove_dir(&share);
    if let Err(e) = std::fs::remove_dir(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(dir = %dir.display(), error = %e, "microvm directory left in place");
        }
    }
}

/// Unmounts `target` (lazily: nothing may hold it once QEMU is dead).
pub fn unmount(target: &Path) {
    use std::os::unix::ffi::OsStrExt;
    if let Ok(c) = std::ffi::CString::new(target.as_os_str().as_bytes()) {
        // SAFETY: a valid NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Mounts the host directory `src` on `dst` in the VM's share: a clone of its mount
/// (`nosuid,nodev`, read-only unless `writable`) idmapped so that its owner, the
/// workspace's host uid `uid`, is uid 1000 to QEMU and the guest, and what they create is
/// stored as `uid` ([`crate::backend::idmap`]). Nothing is followed: `src` is opened
/// without following a final link.
fn bind(src: &Path, dst: &Path, writable: bool, uid: u32) -> Result<(), VmError> {
    use crate::backend::mount_tree::{clone_tree, job_attrs, move_onto, set_idmap};
    let fail = |what: &str, e: std::io::Error| {
        VmError::Claim(format!(
            "{what} {} on {}: {e}",
            src.display(),
            dst.display()
        ))
    };
    let tree = clone_tree(src, false, job_attrs(writable)).map_err(|e| fail("clone", e))?;
    let userns = crate::backend::idmap::mapping(uid, SANDBOX_UID).map_err(|e| fail("idmap", e))?;
    set_idmap(&tree, &userns).map_err(|e| fail("idmap", e))?;
    move_onto(&tree, dst, rustix::fs::OFlags::DIRECTORY).map_err(|e| fail("mount", e))
}

async fn console_text(
    console: Option<capture::Pending>,
    qemu_err: Option<capture::Pending>,
) -> String {
    let bound = Duration::from_millis(500);
    let mut text = String::new();
    if let Some(c) = console {
        text.push_str(&capture::collect(c, bound).await.text);
    }
    if let Some(c) = qemu_err {
        text.push_str(&capture::collect(c, bound).await.text);
    }
    let tail: String = {
        let chars: Vec<char> = text.trim().chars().collect();
        // Enough for the init's last words before the kernel's register dump and trace.
        chars[chars.len().saturating_sub(6000)..].iter().collect()
    };
    if tail.is_empty() {
        String::new()
    } else {
        format!("; console: {tail}")
    }
}

impl Vm {
    /// The next message from the guest; `None` when the port closed (QEMU ended) or the
    /// guest sent something that is not a message.
    pub async fn next_msg(&mut self) -> Option<GuestMsg> {
        let mut line = Vec::new();
        let n = (&mut self.ctl_r)
            .take(MAX_LINE as u64)
            .read_until(b'\n', &mut line)
            .await
            .ok()?;
        if n == 0 {
            return None;
        }
        serde_json::from_slice(&line).ok()
    }

    /// Whether QEMU is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Mounts the job's directories into the share, idmapped from `host_uid` (their
    /// owner) to the guest's uid 1000, and sends the spec. `mounts`: (host directory,
    /// staging name, writable).
    pub async fn claim(
        &mut self,
        mounts: &[(PathBuf, &'static str, bool)],
        host_uid: u32,
        spec: &JobSpec,
    ) -> Result<(), VmError> {
        for (src, name, writable) in mounts {
            let dst = self.dir.join("share").join(name);
            bind(src, &dst, *writable, host_uid)?;
            self.mounted.push(dst);
        }
        let mut line = serde_json::to_vec(spec).map_err(|e| VmError::Claim(e.to_string()))?;
        line.push(b'\n');
        self.ctl_w
            .write_all(&line)
            .await
            .map_err(|e| VmError::Claim(e.to_string()))
    }

    /// Waits up to `bound` for QEMU to exit (after the guest reported), then kills it.
    pub async fn finish(&mut self, bound: Duration) {
        if tokio::time::timeout(bound, self.child.wait())
            .await
            .is_err()
        {
            self.kill().await;
        }
    }

    /// SIGKILLs QEMU's process group and reaps QEMU.
    pub async fn kill(&mut self) {
        kill_group(self.pgid);
        let _ = self.child.wait().await;
    }

    /// The console's last part, for a failure message (kills QEMU first).
    pub async fn console_tail(&mut self) -> String {
        self.kill().await;
        console_text(self.console.take(), self.qemu_err.take()).await
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        kill_group(self.pgid);
        // QEMU must be gone before the mounts go: wait for it (it was SIGKILLed).
        if let Some(pid) = self.child.id() {
            // SAFETY: reaping our own child.
            unsafe { libc::waitpid(pid as i32, std::ptr::null_mut(), 0) };
        }
        for m in self.mounted.drain(..) {
            unmount(&m);
        }
        remove_dir(Some(&self.dir));
    }
}
