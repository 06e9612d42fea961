//! `--bwrap EXE CTL READY`: the command of a warm bubblewrap sandbox of the worker
//! (`worker/src/backend/bwrap/warm.rs` has the design). bwrap has already made the
//! sandbox (namespaces, mounts, its PID 1, the node's seccomp filters, no capabilities);
//! this process is its PID 2, running as the sandbox user, and only waits to become one
//! job's command.
//!
//! 1. Closes `EXE` (its own binary, which bwrap executed as `/proc/self/fd/EXE`), writes
//!    `R` on the `READY` pipe and closes it.
//! 2. Reads the job from the `CTL` pipe until end of file (at most [`MAX_JOB`] bytes):
//!    NUL-terminated fields `b1`, cwd, argc, argv…, envc, env…. End of file with nothing
//!    read (the worker let the slot go): exits 0 without running anything. A malformed or
//!    truncated message: exits 125 without running anything.
//! 3. Does what bwrap itself does between its setup and the command, in the same order
//!    and with bwrap's own messages: `chdir` to cwd (`bwrap: Can't chdir to …`, exit 1),
//!    the job's variables as the whole environment with `PWD` set to cwd, then `execvp`
//!    (`bwrap: execvp …`, exit 1). So a job sees the process a cold bwrap gives it.
//!
//! The job reaches nothing of this: `CTL` is closed before the exec, and the binary's
//! descriptor at the start.

use std::ffi::{CStr, CString};
use std::os::fd::RawFd;

/// The largest job message accepted (the worker's own bound on a bwrap argv is smaller).
const MAX_JOB: usize = 4 * 1024 * 1024;

/// A job as the worker sends it.
#[derive(Debug, PartialEq, Eq)]
pub struct Job {
    pub cwd: CString,
    pub argv: Vec<CString>,
    pub env: Vec<CString>,
}

/// Never returns.
pub fn main(args: &[std::ffi::OsString]) -> ! {
    let fd = |i: usize| -> RawFd {
        match args
            .get(i)
            .and_then(|a| a.to_str())
            .and_then(|a| a.parse::<RawFd>().ok())
        {
            Some(fd) if fd > 2 => fd,
            _ => {
                eprintln!("cynode-pool-waiter: usage: cynode-pool-waiter --bwrap EXE CTL READY");
                std::process::exit(125);
            }
        }
    };
    let (exe, ctl, ready) = (fd(0), fd(1), fd(2));
    // SAFETY: closing descriptors the worker handed this process, which owns them.
    unsafe {
        libc::close(exe);
        libc::fcntl(ctl, libc::F_SETFD, libc::FD_CLOEXEC);
    }
    // SAFETY: writing one byte from a static buffer.
    if unsafe { libc::write(ready, b"R".as_ptr().cast(), 1) } != 1 {
        std::process::exit(125);
    }
    // SAFETY: as above.
    unsafe { libc::close(ready) };
    let bytes = match read_all(ctl) {
        Ok(b) if b.is_empty() => std::process::exit(0),
        Ok(b) => b,
        Err(e) => {
            eprintln!("cynode-pool-waiter: cannot read the job: {e}");
            std::process::exit(125);
        }
    };
    // SAFETY: as above.
    unsafe { libc::close(ctl) };
    let job = match decode(&bytes) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("cynode-pool-waiter: bad job message: {e}");
            std::process::exit(125);
        }
    };
    exec(&job)
}

/// Reads `fd` to end of file, at most [`MAX_JOB`] bytes.
fn read_all(fd: RawFd) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = [0u8; 16384];
    loop {
        // SAFETY: reading into a buffer of its length.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Ok(out);
        }
        out.extend_from_slice(&buf[..n as usize]);
        if out.len() > MAX_JOB {
            return Err(std::io::Error::other("the job message is too large"));
        }
    }
}

/// Parses the job message.
pub fn decode(body: &[u8]) -> Result<Job, String> {
    let Some(body) = body.strip_suffix(b"\0") else {
        return Err("not NUL-terminated".into());
    };
    let mut fields = body.split(|b| *b == 0);
    let mut next = |what: &str| fields.next().ok_or_else(|| format!("no {what}"));
    if next("version")? != b"b1" {
        return Err("unknown version".into());
    }
    let c = |f: &[u8]| CString::new(f).map_err(|_| "a NUL in a field".to_string());
    let count = |f: &[u8]| -> Result<usize, String> {
        std::str::from_utf8(f)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| "a bad count".to_string())
    };
    let cwd = c(next("cwd")?)?;
    let argc = count(next("argc")?)?;
    if argc == 0 {
        return Err("an empty argv".into());
    }
    let argv = (0..argc)
        .map(|_| next("argument").and_then(&c))
        .collect::<Result<Vec<_>, _>>()?;
    let envc = count(next("envc")?)?;
    let env = (0..envc)
        .map(|_| next("variable").and_then(&c))
        .collect::<Result<Vec<_>, _>>()?;
    if next("end").is_ok() {
        return Err("trailing fields".into());
    }
    Ok(Job { cwd, argv, env })
}

/// The job's environment as bwrap leaves it after `--clearenv` and its `--setenv`s: the
/// job's variables in order, then `PWD` (replaced where the job set it, as setenv does).
pub fn environment(job: &Job) -> Vec<CString> {
    let mut pwd = b"PWD=".to_vec();
    pwd.extend_from_slice(job.cwd.as_bytes());
    // A CString's bytes hold no NUL, so neither does PWD's line.
    let pwd = CString::new(pwd).unwrap_or_default();
    let mut env = job.env.clone();
    match env.iter_mut().find(|e| e.as_bytes().starts_with(b"PWD=")) {
        Some(e) => *e = pwd,
        None => env.push(pwd),
    }
    env
}

/// bwrap's own error format: `bwrap: WHAT: strerror`, exit 1.
fn die(what: &str, err: i32) -> ! {
    // SAFETY: strerror returns a valid C string for any errno.
    let msg = unsafe { CStr::from_ptr(libc::strerror(err)) };
    eprintln!("bwrap: {what}: {}", msg.to_string_lossy());
    std::process::exit(1);
}

/// chdir, the environment, execvp: what bwrap does last.
fn exec(job: &Job) -> ! {
    // SAFETY: a valid C string.
    if unsafe { libc::chdir(job.cwd.as_ptr()) } != 0 {
        die(
            &format!("Can't chdir to {}", job.cwd.to_string_lossy()),
            super::errno(),
        );
    }
    let env = environment(job);
    let mut envp: Vec<*mut libc::c_char> = env.iter().map(|e| e.as_ptr().cast_mut()).collect();
    envp.push(std::ptr::null_mut());
    let mut argv: Vec<*const libc::c_char> = job.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    extern "C" {
        static mut environ: *mut *mut libc::c_char;
    }
    // SAFETY: single-threaded; `envp` (and the strings it points to) outlive the exec
    // call, and execvp looks PATH up in `environ`, as bwrap's own execvp does.
    unsafe {
        environ = envp.as_mut_ptr();
        libc::execvp(argv[0], argv.as_ptr());
    }
    die(
        &format!("execvp {}", job.argv[0].to_string_lossy()),
        super::errno(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(fields: &[&str]) -> Vec<u8> {
        let mut v = Vec::new();
        for f in fields {
            v.extend_from_slice(f.as_bytes());
            v.push(0);
        }
        v
    }

    #[test]
    fn a_job_message_decodes() {
        let j = decode(&msg(&["b1", "/job", "2", "sh", "-c", "1", "A=b"])).unwrap();
        assert_eq!(j.cwd.as_bytes(), b"/job");
        assert_eq!(j.argv.len(), 2);
        assert_eq!(j.env[0].as_bytes(), b"A=b");
    }

    #[test]
    fn malformed_messages_are_refused() {
        for bad in [
            msg(&["b2", "/", "1", "true", "0"]),
            msg(&["b1", "/", "0", "0"]),
            msg(&["b1", "/", "2", "true", "0"]),
            msg(&["b1", "/", "1", "true", "1"]),
            msg(&["b1", "/", "1", "true", "0", "extra"]),
            msg(&["b1", "/", "x", "true", "0"]),
            b"b1\x00/\x001\x00true\x000".to_vec(),
        ] {
            assert!(decode(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn pwd_is_set_last_or_replaced_in_place() {
        let j = decode(&msg(&["b1", "/w", "1", "true", "2", "A=1", "B=2"])).unwrap();
        let e: Vec<_> = environment(&j)
            .into_iter()
            .map(|c| c.into_bytes())
            .collect();
        assert_eq!(e, [&b"A=1"[..], b"B=2", b"PWD=/w"]);
        let j = decode(&msg(&["b1", "/w", "1", "true", "2", "PWD=x", "B=2"])).unwrap();
        let e: Vec<_> = environment(&j)
            .into_iter()
            .map(|c| c.into_bytes())
            .collect();
        assert_eq!(e, [&b"PWD=/w"[..], b"B=2"]);
    }
}
