//! The sandbox contract: what every sandbox the node starts looks like from inside, in one
//! place. The uid it runs as, where the workspace and the job directory are mounted, the
//! env names the node sets (which a request can never override), the in-sandbox URLs of
//! the node's sockets, and [`spec`], the one builder of a [`SandboxSpec`] for jobs and
//! sessions alike (mounts, workdir, no network by default, the node's resource limits and
//! output cap), [`bind_job_socket`], how a node socket appears in the job directory, and
//! [`serve_job_socket`], the one way the node serves such a socket (status, inference,
//! gateway).
//!
//! A leaf: it knows the config's limits and the protocol, nothing else of the node.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cynode_protocol::worker_api::{NetworkPolicy, RESERVED_ENV};

use crate::config::Limits;

/// The uid/gid a bwrap sandbox sees itself as inside its user namespace. On the host every
/// sandbox runs as its workspace's own uid ([`crate::uid_pool`], [`SandboxSpec::host_uid`]),
/// which bwrap maps to this one; Podman and Docker run as the host uid itself.
pub const SANDBOX_UID: u32 = 1000;
/// [`SANDBOX_UID`] as text, for the backends' argv.
pub const SANDBOX_UID_TEXT: &str = "1000";

/// `uid:gid` for the engines' `--user`: the host uid, as both.
pub fn engine_user(host_uid: u32) -> String {
    format!("{host_uid}:{host_uid}")
}
/// Where the workspace is mounted, writable; also every sandbox's working directory.
pub const WORKSPACE_MOUNT: &str = "/workspace";
/// Where a job's directory is mounted (jobs only; sessions have none).
pub const JOB_MOUNT: &str = "/job";
/// The artifacts directory as the sandbox sees it.
pub const ARTIFACTS_MOUNT: &str = "/job/artifacts";

/// The task the sandbox works for.
pub const ENV_TASK_ID: &str = "CYNODE_TASK_ID";
/// The job (for a session: the session id).
pub const ENV_JOB_ID: &str = "CYNODE_JOB_ID";
/// [`WORKSPACE_MOUNT`].
pub const ENV_WORKSPACE_DIR: &str = "CYNODE_WORKSPACE_DIR";
/// [`ARTIFACTS_MOUNT`] (jobs only).
pub const ENV_ARTIFACTS_DIR: &str = "CYNODE_ARTIFACTS_DIR";
/// The session (sessions only).
pub const ENV_SESSION_ID: &str = "CYNODE_SESSION_ID";
/// [`PROXY_URL`], for jobs that use inference.
pub const ENV_INFERENCE_PROXY_URL: &str = "INFERENCE_PROXY_URL";
/// [`STATUS_URL`], for SBA jobs.
pub const ENV_SBA_STATUS_URL: &str = "SBA_JOB_STATUS_URL";
/// The node's bound on an agent job's model calls.
pub const ENV_SBA_AGENT_MAX_TURNS: &str = "SBA_AGENT_MAX_TURNS";
/// The PATH a sandbox gets when its request sets none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The HOME a sandbox gets when its request sets none: its own tmpfs `/tmp` (sized by
/// `limits.tmpfs_mb`, charged to its memory limit, gone with the sandbox), the one
/// directory every backend makes writable for whatever uid the job runs as. The image's home
/// cannot serve: the root is read-only, and its owner (uid 1000) is not the uid a job has
/// under Podman, Docker or gVisor (the workspace's host uid, [`engine_user`]).
pub const DEFAULT_HOME: &str = "/tmp";

/// The lifecycle socket's file name in the job directory.
pub const STATUS_SOCKET: &str = "status.sock";
/// Where the SBA's lifecycle socket appears inside the sandbox.
pub const STATUS_URL: &str = "http+unix://%2Fjob%2Fstatus.sock/status";
/// The inference proxy socket's file name in the job directory.
pub const INFERENCE_SOCKET: &str = "inference.sock";
/// `INFERENCE_PROXY_URL` as the sandbox sees it.
pub const PROXY_URL: &str = "http+unix://%2Fjob%2Finference.sock";

/// A job socket being served; dropping it stops its accept loop (closing every
/// connection) and removes the socket.
#[derive(Debug)]
pub struct JobSocket {
    stop: tokio_util::sync::CancellationToken,
    path: PathBuf,
}

impl Drop for JobSocket {
    fn drop(&mut self) {
        self.stop.cancel();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Binds `<dir>/<name>` as [`bind_job_socket`] does and serves `router` on it through the
/// node's bounded accept loop (`cynode_tls::serve_unix`, under `limits`) until the
/// returned [`JobSocket`] is dropped. Must be called within the node's tokio runtime.
pub fn serve_job_socket(
    dir: &Path,
    name: &str,
    owner: Option<u32>,
    mode: u32,
    router: axum::Router,
    limits: &cynode_tls::ListenerLimits,
) -> std::io::Result<JobSocket> {
    let (path, listener) = bind_job_socket(dir, name, owner, mode)?;
    let stop = tokio_util::sync::CancellationToken::new();
    let done = stop.clone();
    tokio::spawn(cynode_tls::serve_unix(
        listener,
        router,
        limits.clone(),
        async move { done.cancelled().await },
    ));
    Ok(JobSocket { stop, path })
}

/// Binds the socket `<dir>/<name>` a sandbox reaches under [`JOB_MOUNT`], replacing a
/// stale one. It binds through `/proc/self/fd/<dir fd>/<name>`, so a long state path still
/// fits in a socket address. `owner`: the uid/gid the socket is given when the node may
/// chown (otherwise it keeps the node's, logged); then its mode is `mode`. The job
/// directory is the sandbox's: the name is unlinked, re-owned and re-moded beneath the
/// directory's fd and never through a link (the bound socket is reopened `O_PATH |
/// O_NOFOLLOW`, checked to be a socket, and changed through that fd). Must be called
/// within the node's tokio runtime.
pub fn bind_job_socket(
    dir: &Path,
    name: &str,
    owner: Option<u32>,
    mode: u32,
) -> std::io::Result<(PathBuf, tokio::net::UnixListener)> {
    use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
    use std::os::fd::AsRawFd;
    let dir_fd = crate::fd_walk::open_node_dir(dir)?;
    match rfs::unlinkat(&dir_fd, name, AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => {}
        Err(e) => return Err(e.into()),
    }
    let short = format!("/proc/self/fd/{}/{name}", dir_fd.as_raw_fd());
    let listener = std::os::unix::net::UnixListener::bind(&short)?;
    let sock = rfs::openat(
        &dir_fd,
        name,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let st = rfs::fstat(&sock)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::Socket {
        return Err(std::io::Error::other(format!(
            "{name} was replaced while it was bound"
        )));
    }
    if let Some(id) = owner {
        let (uid, gid) = (rfs::Uid::from_raw(id), rfs::Gid::from_raw(id));
        if let Err(e) = rfs::chownat(&sock, "", Some(uid), Some(gid), AtFlags::EMPTY_PATH) {
            tracing::debug!(error = %e, socket = name, "socket keeps the node's owner");
        }
    }
    // chmod through the O_PATH fd's /proc entry: that is the socket's own inode.
    rfs::chmod(
        format!("/proc/self/fd/{}", sock.as_raw_fd()).as_str(),
        Mode::from_raw_mode(mode),
    )?;
    listener.set_nonblocking(true)?;
    Ok((
        dir.join(name),
        tokio::net::UnixListener::from_std(listener)?,
    ))
}

/// A bind mount into the sandbox.
#[derive(Debug, Clone)]
pub struct Mount {
    pub host: PathBuf,
    pub target: String,
    pub writable: bool,
}

/// Resource limits for one sandbox.
#[derive(Debug, Clone, Copy)]
pub struct ResourceLimits {
    pub memory_mb: u64,
    pub pids: u64,
    pub cpus: f64,
    pub tmpfs_mb: u64,
}

impl ResourceLimits {
    /// The node's configured limits.
    pub fn from_limits(l: &Limits) -> Self {
        ResourceLimits {
            memory_mb: l.memory_mb,
            pids: l.pids,
            cpus: l.cpus,
            tmpfs_mb: l.tmpfs_mb,
        }
    }
}

/// Everything a backend needs to start one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    /// Unique name (`cynode-<job_id>`), also the container name.
    pub name: String,
    pub image: String,
    /// argv; empty means the image's entrypoint with no arguments.
    pub command: Vec<String>,
    /// Whether `command` replaces the image entrypoint (plain jobs) or is passed to it
    /// (SBA jobs).
    pub override_entrypoint: bool,
    pub env: Vec<(String, String)>,
    pub mounts: Vec<Mount>,
    pub workdir: String,
    pub network: NetworkPolicy,
    pub limits: ResourceLimits,
    pub labels: Vec<(String, String)>,
    pub timeout: Duration,
    pub output_cap: usize,
    /// The host uid (and gid) the sandbox runs as: its workspace's ([`crate::uid_pool`]).
    pub host_uid: u32,
}

/// What differs between one sandbox and another; [`spec`] adds the rest.
#[derive(Debug, Clone)]
pub struct SandboxRequest {
    pub name: String,
    pub image: String,
    pub command: Vec<String>,
    pub override_entrypoint: bool,
    pub env: Vec<(String, String)>,
    /// Mounted at [`WORKSPACE_MOUNT`].
    pub workspace: PathBuf,
    /// Mounted at [`JOB_MOUNT`], for jobs.
    pub job_dir: Option<PathBuf>,
    pub network: NetworkPolicy,
    /// `cynodeai.task_id` and the job's or session's own label.
    pub labels: Vec<(String, String)>,
    pub timeout: Duration,
    /// The workspace's host uid ([`crate::uid_pool::UidPool::for_workspace`]).
    pub host_uid: u32,
}

/// The one sandbox spec builder: `req`'s mounts (the job directory, then the workspace,
/// both writable), the workspace as working directory, and the node's resource limits
/// and output cap.
pub fn spec(limits: &Limits, req: SandboxRequest) -> SandboxSpec {
    let mut mounts = Vec::with_capacity(2);
    if let Some(job_dir) = req.job_dir {
        mounts.push(Mount {
            host: job_dir,
            target: JOB_MOUNT.into(),
            writable: true,
        });
    }
    mounts.push(Mount {
        host: req.workspace,
        target: WORKSPACE_MOUNT.into(),
        writable: true,
    });
    SandboxSpec {
        name: req.name,
        image: req.image,
        command: req.command,
        override_entrypoint: req.override_entrypoint,
        env: req.env,
        mounts,
        workdir: WORKSPACE_MOUNT.into(),
        network: req.network,
        limits: ResourceLimits::from_limits(limits),
        labels: req.labels,
        timeout: req.timeout,
        output_cap: limits.output_cap_bytes,
        host_uid: req.host_uid,
    }
}

/// A sandbox's env: the requested variables except the reserved names and those `drop`
/// refuses, then the node's own `node` variables, then [`DEFAULT_PATH`] when no `PATH`
/// and [`DEFAULT_HOME`] when no `HOME` was given.
pub fn env<'a>(
    requested: impl IntoIterator<Item = (&'a String, &'a String)>,
    drop: impl Fn(&str) -> bool,
    node: impl IntoIterator<Item = (&'static str, String)>,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = requested
        .into_iter()
        .filter(|(k, _)| !RESERVED_ENV.contains(&k.as_str()) && !drop(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    env.extend(node.into_iter().map(|(k, v)| (k.to_string(), v)));
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), DEFAULT_PATH.into()));
    }
    if !env.iter().any(|(k, _)| k == "HOME") {
        env.push(("HOME".into(), DEFAULT_HOME.into()));
    }
    env
}

/// A small spec for unit tests of the backends' argv builders.
#[cfg(test)]
pub fn example_spec(image: &str, command: &[&str]) -> SandboxSpec {
    SandboxSpec {
        name: "cynode-j".into(),
        image: image.into(),
        command: command.iter().map(|s| s.to_string()).collect(),
        override_entrypoint: true,
        env: vec![("A".into(), "b".into())],
        mounts: vec![Mount {
            host: "/h".into(),
            target: WORKSPACE_MOUNT.into(),
            writable: true,
        }],
        workdir: WORKSPACE_MOUNT.into(),
        network: cynode_protocol::worker_api::NetworkPolicy::None,
        limits: ResourceLimits {
            memory_mb: 64,
            pids: 16,
            cpus: 0.5,
            tmpfs_mb: 8,
        },
        labels: Vec::new(),
        timeout: std::time::Duration::from_secs(1),
        output_cap: 1,
        host_uid: 4_000_000,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_planted_link_at_the_socket_name_is_replaced_not_followed() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let t = tempfile::tempdir().unwrap();
        let canary = tempfile::NamedTempFile::new().unwrap();
        std::fs::set_permissions(canary.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(canary.path(), t.path().join("s.sock")).unwrap();
        let (path, _l) = bind_job_socket(t.path(), "s.sock", Some(4321), 0o660).unwrap();
        let m = std::fs::symlink_metadata(&path).unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()));
        assert_eq!(m.mode() & 0o777, 0o660);
        let c = std::fs::metadata(canary.path()).unwrap();
        assert_eq!(c.mode() & 0o777, 0o600);
        assert_ne!(c.uid(), 4321);
    }

    #[test]
    fn uid_texts_agree() {
        assert_eq!(SANDBOX_UID_TEXT, SANDBOX_UID.to_string());
        assert_eq!(engine_user(4_000_000), "4000000:4000000");
    }
}
