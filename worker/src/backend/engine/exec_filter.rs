//! gVisor session commands under the node's seccomp filter. `runsc exec` does not apply
//! the container's OCI seccomp profile to the processes it starts, so a session command
//! under gVisor could make calls every job is denied (a user namespace of gVisor's own
//! kernel, for one). gVisor's kernel does apply a filter a process installs itself: each
//! command of a gVisor session runs through the static pool waiter's `--seccomp-exec`
//! mode, which installs the node's BPF programs (those bubblewrap gets,
//! [`crate::backend::seccomp::bpf_programs`]) with no_new_privs, then executes the command.
//!
//! The waiter and the programs are in a directory the node makes once
//! (`<state>/seccomp/exec-<digest>/`, root's, read-only to others), mounted read-only at
//! [`MOUNT`] in the session's container. A command cannot skip the wrapper: the node
//! builds the `exec` argv, and the filter is inherited by everything the command starts.

use std::path::{Path, PathBuf};

use super::EngineBackend;
use crate::backend::{seccomp, BackendError};
use crate::sandbox::Mount;

/// Where the directory appears in a gVisor session container.
pub const MOUNT: &str = "/.cynode-seccomp";
/// The waiter's name in the directory.
const WAITER: &str = "cynode-pool-waiter";

impl EngineBackend {
    /// The mount of the directory (made if missing): the waiter, `filter-<n>.bpf`.
    pub(super) fn exec_filter_mount(&self) -> Result<Mount, BackendError> {
        let programs = seccomp::bpf_programs()
            .map_err(|e| BackendError::Unavailable(format!("seccomp programs: {e}")))?;
        let waiter = self.pool().waiter();
        // Named for the programs and the waiter both: a rebuilt waiter gets a new copy.
        let digest = {
            use sha2::Digest;
            let mut h = sha2::Sha256::new();
            for p in &programs {
                h.update((p.len() as u64).to_le_bytes());
                h.update(p);
            }
            h.update(std::fs::read(waiter).unwrap_or_default());
            hex::encode(h.finalize())
        };
        let base = self.profile_dir();
        let dir = base.join(format!("exec-{}", &digest[..16]));
        if !dir.join(WAITER).is_file() {
            make(&base, &dir, &programs, waiter).map_err(|e| {
                BackendError::Unavailable(format!(
                    "gVisor session commands run under the node's seccomp filter through the pool waiter {}, which could not be placed ({e}): build it with deploy/worker/build-waiter.sh or set {}.pool_waiter",
                    waiter.display(),
                    self.kind.as_str()
                ))
            })?;
        }
        Ok(Mount {
            host: dir,
            target: MOUNT.into(),
            writable: false,
        })
    }
}

/// Writes the directory under a temporary name and renames it into place (several
/// sessions may start at once).
fn make(base: &Path, dir: &Path, programs: &[Vec<u8>], waiter: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(base)?;
    let tmp = tempfile::Builder::new().prefix(".exec-").tempdir_in(base)?;
    std::fs::copy(waiter, tmp.path().join(WAITER))?;
    std::fs::set_permissions(
        tmp.path().join(WAITER),
        std::fs::Permissions::from_mode(0o555),
    )?;
    for (i, p) in programs.iter().enumerate() {
        let f = tmp.path().join(format!("filter-{i}.bpf"));
        std::fs::write(&f, p)?;
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o444))?;
    }
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755))?;
    let tmp: PathBuf = tmp.keep();
    match std::fs::rename(&tmp, dir) {
        Ok(()) => Ok(()),
        // Another session placed it first.
        Err(_) if dir.join(WAITER).is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}

/// Removes what earlier runs of the node left in `base` (`<state>/seccomp/`): `exec-*`
/// directories of other waiters or programs, `.exec-*` ones a killed node left half made,
/// and seccomp profiles other than `keep`. Called at startup, after the node's containers
/// are removed, so none of them is in use. The directory is the node's own (root's, never
/// writable by a sandbox). Returns how many entries went.
pub fn sweep(base: &Path, keep: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(base) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let Ok(kind) = e.file_type() else { continue };
        let gone = if kind.is_dir() && (name.starts_with("exec-") || name.starts_with(".exec-")) {
            std::fs::remove_dir_all(e.path())
        } else if kind.is_file()
            && name.starts_with("profile-")
            && Some(e.file_name().as_os_str()) != keep.file_name()
        {
            std::fs::remove_file(e.path())
        } else {
            continue;
        };
        match gone {
            Ok(()) => removed += 1,
            Err(err) => {
                tracing::warn!(path = %e.path().display(), error = %err, "cannot remove an old seccomp file")
            }
        }
    }
    removed
}

/// `command` run through the waiter's `--seccomp-exec`.
pub fn wrap(command: &[String]) -> Vec<String> {
    let mut argv = vec![
        format!("{MOUNT}/{WAITER}"),
        "--seccomp-exec".into(),
        MOUNT.into(),
        "--".into(),
    ];
    argv.extend(command.iter().cloned());
    argv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_removes_old_exec_directories_and_profiles_and_keeps_the_current_one() {
        let base = tempfile::tempdir().unwrap();
        let b = base.path();
        for d in ["exec-0123456789abcdef", ".exec-AbC123"] {
            std::fs::create_dir_all(b.join(d)).unwrap();
            std::fs::write(b.join(d).join(WAITER), b"x").unwrap();
        }
        std::fs::write(b.join("profile-old.json"), b"{}").unwrap();
        std::fs::write(b.join("profile-new.json"), b"{}").unwrap();
        std::fs::write(b.join("unrelated"), b"").unwrap();
        assert_eq!(sweep(b, &b.join("profile-new.json")), 3);
        let mut left: Vec<_> = std::fs::read_dir(b)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["profile-new.json", "unrelated"]);
        assert_eq!(sweep(&b.join("missing"), &b.join("profile-new.json")), 0);
    }
}
