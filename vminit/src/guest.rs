//! PID 1 inside the guest: mounts `/proc`, `/sys`, `/dev`, `/run`; says it is ready;
//! reads one [`JobSpec`]; mounts the share and its sub-directories, a sized `/tmp` and a
//! cgroup with the job's memory and pids limits; runs the job as its uid under the node's
//! seccomp programs with no-new-privileges; reports how it ended; kills what is left and
//! reboots. Every failure is reported on the control port and ends in a reboot too: the
//! guest never outlives its one job.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use crate::{GuestMsg, JobSpec, CTL_PORT, ERR_PORT, MAX_LINE, OUT_PORT, SHARE_MOUNT, SHARE_TAG};

/// The cgroup the job runs in.
const JOB_CGROUP: &str = "/sys/fs/cgroup/job";

/// Why the guest could not run the job.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("bad job spec: {0}")]
    Spec(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> InitError {
    let what = what.into();
    move |source| InitError::Io { what, source }
}

fn cstr(s: &str) -> Result<CString, InitError> {
    CString::new(s).map_err(|_| InitError::Spec(format!("NUL in {s:?}")))
}

/// mount(2) with optional type and data.
fn mount(
    src: &str,
    target: &str,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), InitError> {
    let (s, t) = (cstr(src)?, cstr(target)?);
    let f = fstype.map(cstr).transpose()?;
    let d = data.map(cstr).transpose()?;
    // SAFETY: every pointer is a valid NUL-terminated string or null.
    let rc = unsafe {
        libc::mount(
            s.as_ptr(),
            t.as_ptr(),
            f.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            flags,
            d.as_ref()
                .map_or(std::ptr::null(), |c| c.as_ptr().cast::<libc::c_void>()),
        )
    };
    if rc != 0 {
        return Err(io(format!("mount {src} on {target}"))(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

const SAFE: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV;

/// The mounts every guest has before it is ready.
fn base_mounts() -> Result<(), InitError> {
    mount("proc", "/proc", Some("proc"), SAFE | libc::MS_NOEXEC, None)?;
    mount("sysfs", "/sys", Some("sysfs"), SAFE | libc::MS_NOEXEC, None)?;
    // The kernel mounts devtmpfs on /dev only for an initramfs; a root fs needs it here.
    match mount("devtmpfs", "/dev", Some("devtmpfs"), libc::MS_NOSUID, None) {
        Ok(()) => {}
        Err(InitError::Io { source, .. }) if source.raw_os_error() == Some(libc::EBUSY) => {}
        Err(e) => return Err(e),
    }
    mount(
        "run",
        "/run",
        Some("tmpfs"),
        SAFE,
        Some("size=1m,mode=0755"),
    )?;
    mount(
        "cgroup2",
        "/sys/fs/cgroup",
        Some("cgroup2"),
        SAFE | libc::MS_NOEXEC,
        None,
    )?;
    Ok(())
}

/// The device of the virtio-serial port named `name`. Ports appear asynchronously after
/// the console driver probed (the host announces them): wait up to 10 s.
fn port(name: &str) -> Result<String, InitError> {
    for _ in 0..5000 {
        if let Ok(entries) = std::fs::read_dir("/sys/class/virtio-ports") {
            for e in entries.flatten() {
                let n = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
                let dev = format!("/dev/{}", e.file_name().to_string_lossy());
                if n.trim() == name && std::path::Path::new(&dev).exists() {
                    return Ok(dev);
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    Err(InitError::Spec(format!("no virtio-serial port {name}")))
}

/// The control port: line-delimited JSON both ways.
struct Ctl {
    reader: BufReader<File>,
    writer: File,
}

impl Ctl {
    fn open() -> Result<Ctl, InitError> {
        let dev = port(CTL_PORT)?;
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&dev)
            .map_err(io(format!("open {dev}")))?;
        let writer = f.try_clone().map_err(io("dup control port"))?;
        Ok(Ctl {
            reader: BufReader::new(f),
            writer,
        })
    }

    fn send(&mut self, msg: &GuestMsg) -> Result<(), InitError> {
        let mut line = serde_json::to_vec(msg).map_err(|e| InitError::Spec(e.to_string()))?;
        line.push(b'\n');
        // Until the node has connected its end, the port refuses writes: retry briefly.
        for _ in 0..2000 {
            match self.writer.write_all(&line) {
                Ok(()) => return Ok(()),
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
            }
        }
        self.writer
            .write_all(&line)
            .map_err(io("write control port"))
    }

    fn read_spec(&mut self) -> Result<JobSpec, InitError> {
        let mut line = Vec::new();
        loop {
            let n = (&mut self.reader)
                .take((MAX_LINE - line.len()) as u64)
                .read_until(b'\n', &mut line)
                .map_err(io("read control port"))?;
            if line.ends_with(b"\n") {
                break;
            }
            if line.len() >= MAX_LINE {
                return Err(InitError::Spec("spec line too long".into()));
            }
            if n == 0 {
                // Nothing yet (the node's end is not connected): wait for it.
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
        serde_json::from_slice(&line).map_err(|e| InitError::Spec(e.to_string()))
    }
}

/// The job's mounts: the share, its sub-directories at their targets, `/tmp`.
fn job_mounts(spec: &JobSpec) -> Result<(), InitError> {
    mount(
        SHARE_TAG,
        SHARE_MOUNT,
        Some("9p"),
        SAFE,
        Some("trans=virtio,version=9p2000.L,msize=262144,cache=none,access=client"),
    )?;
    for m in &spec.mounts {
        if m.source.is_empty() || m.source.contains('/') || m.source.starts_with('.') {
            return Err(InitError::Spec(format!("bad share source {:?}", m.source)));
        }
        let src = format!("{SHARE_MOUNT}/{}", m.source);
        mount(&src, &m.target, None, libc::MS_BIND, None)?;
        let mut flags = libc::MS_BIND | libc::MS_REMOUNT | SAFE;
        if !m.writable {
            flags |= libc::MS_RDONLY;
        }
        mount(&src, &m.target, None, flags, None)?;
    }
    // The share itself is only reachable through those binds.
    let share = cstr(SHARE_MOUNT)?;
    // SAFETY: a valid NUL-terminated path.
    unsafe { libc::umount2(share.as_ptr(), libc::MNT_DETACH) };
    mount(
        "tmpfs",
        "/tmp",
        Some("tmpfs"),
        SAFE,
        Some(&format!("size={}m,mode=1777", spec.tmpfs_mb.max(1))),
    )?;
    // /dev/shm for runtimes that want it, inside the same memory limit.
    let _ = std::fs::create_dir_all("/dev/shm");
    mount(
        "shm",
        "/dev/shm",
        Some("tmpfs"),
        SAFE | libc::MS_NOEXEC,
        Some("size=16m,mode=1777"),
    )?;
    Ok(())
}

/// A cgroup with `memory.max` and `pids.max`; returns its `cgroup.procs` path.
fn job_cgroup(spec: &JobSpec) -> Result<CString, InitError> {
    let w = |file: &str, value: &str| {
        std::fs::write(format!("/sys/fs/cgroup/{file}"), value).map_err(io(format!("write {file}")))
    };
    w("cgroup.subtree_control", "+memory +pids")?;
    std::fs::create_dir(JOB_CGROUP).map_err(io("mkdir job cgroup"))?;
    w(
        "job/memory.max",
        &(spec.memory_mb * 1024 * 1024).to_string(),
    )?;
    w("job/pids.max", &spec.pids.to_string())?;
    // A job that hits memory.max is killed whole, like a container's OOM kill.
    let _ = w("job/memory.oom.group", "1");
    cstr(&format!("{JOB_CGROUP}/cgroup.procs"))
}

/// The seccomp programs as `sock_filter` arrays.
fn seccomp_programs(spec: &JobSpec) -> Result<Vec<Vec<libc::sock_filter>>, InitError> {
    spec.seccomp
        .iter()
        .map(|h| {
            let bytes = hex::decode(h).map_err(|e| InitError::Spec(format!("seccomp: {e}")))?;
            if bytes.len() % 8 != 0 || bytes.is_empty() {
                return Err(InitError::Spec("seccomp program length".into()));
            }
            Ok(bytes
                .chunks_exact(8)
                .map(|c| libc::sock_filter {
                    code: u16::from_ne_bytes([c[0], c[1]]),
                    jt: c[2],
                    jf: c[3],
                    k: u32::from_ne_bytes([c[4], c[5], c[6], c[7]]),
                })
                .collect())
        })
        .collect()
}

/// Starts the job: between fork and exec it joins the job cgroup, drops to the job's uid
/// and gid with no supplementary groups, sets no-new-privileges and installs the filters.
fn spawn_job(spec: &JobSpec, procs: CString) -> Result<u32, InitError> {
    let (program, args) = spec
        .argv
        .split_first()
        .ok_or_else(|| InitError::Spec("empty argv".into()))?;
    let open = |name: &str| {
        let dev = port(name)?;
        OpenOptions::new()
            .write(true)
            .open(&dev)
            .map_err(io(format!("open {dev}")))
    };
    let (out, err) = (open(OUT_PORT)?, open(ERR_PORT)?);
    let filters = seccomp_programs(spec)?;
    let id = spec.uid;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&spec.workdir)
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .process_group(0);
    // SAFETY: between fork and exec only async-signal-safe syscalls run, on memory
    // prepared before the fork (the procs path, the filter arrays).
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(fd);
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(id) != 0
                || libc::setuid(id) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            for f in &filters {
                let prog = libc::sock_fprog {
                    len: f.len() as u16,
                    filter: f.as_ptr().cast_mut(),
                };
                if libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    &prog as *const libc::sock_fprog,
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(io(format!("exec {program}")))?;
    Ok(child.id())
}

/// Reaps every child until `pid` ends; returns its exit code (128 + signal when killed).
fn wait_for(pid: u32) -> i32 {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid status pointer.
        let got = unsafe { libc::waitpid(-1, &mut status, 0) };
        if got < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return 128 + libc::SIGKILL;
        }
        if got as u32 == pid {
            if libc::WIFEXITED(status) {
                return libc::WEXITSTATUS(status);
            }
            if libc::WIFSIGNALED(status) {
                return 128 + libc::WTERMSIG(status);
            }
        }
    }
}

/// Kills everything but PID 1 and reaps it.
fn kill_the_rest() {
    // SAFETY: kill(-1) from PID 1 signals every other process of the guest.
    unsafe { libc::kill(-1, libc::SIGKILL) };
    loop {
        // SAFETY: waitpid with a null status pointer is allowed.
        if unsafe { libc::waitpid(-1, std::ptr::null_mut(), 0) } < 0 {
            break;
        }
    }
}

/// Flushes and resets the machine; QEMU runs with `-no-reboot`, so that ends it.
pub fn reboot() -> ! {
    // SAFETY: plain syscalls; as PID 1 reboot(2) restarts the machine.
    unsafe {
        libc::sync();
        libc::reboot(libc::LINUX_REBOOT_CMD_RESTART);
    }
    // reboot only returns on error: exiting PID 1 panics the kernel, which also resets.
    std::process::exit(1)
}

fn console(msg: &str) {
    eprintln!("cynode-vminit: {msg}");
}

/// PID 1's whole life.
pub fn run() -> ! {
    if let Err(e) = base_mounts() {
        console(&e.to_string());
        reboot();
    }
    let mut ctl = match Ctl::open() {
        Ok(c) => c,
        Err(e) => {
            console(&e.to_string());
            reboot();
        }
    };
    let result = ctl
        .send(&GuestMsg::Ready)
        .and_then(|()| ctl.read_spec())
        .and_then(|spec| {
            job_mounts(&spec)?;
            let procs = job_cgroup(&spec)?;
            let pid = spawn_job(&spec, procs)?;
            ctl.send(&GuestMsg::Started)?;
            Ok(wait_for(pid))
        });
    kill_the_rest();
    let msg = match result {
        Ok(code) => GuestMsg::Exited { code },
        Err(e) => {
            console(&e.to_string());
            GuestMsg::Failed {
                message: e.to_string(),
            }
        }
    };
    let _ = ctl.send(&msg);
    reboot()
}
