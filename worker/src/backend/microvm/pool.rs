//! The warm pool: per image, up to `pool_size` booted VMs wait for a job. A claim takes
//! one (or boots one when none waits) and starts a refill; every VM serves one job and is
//! destroyed after it, so nothing a job did can reach the next.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::vm::{Launch, Vm, VmError};
use crate::backend::ResourceLimits;

/// How many boots a VM gets when its guest fails before it is ready.
const BOOT_ATTEMPTS: u32 = 8;
/// The pause before the second boot; it grows by as much before each next one.
const BOOT_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);
/// What the pool needs to boot a VM for an image: everything but the directory.
pub type Template = Launch;

/// The pool.
#[derive(Debug, Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    size: usize,
    vms_dir: PathBuf,
    seq: AtomicU64,
    idle: Mutex<HashMap<String, Vec<Vm>>>,
    booting: Mutex<HashMap<String, usize>>,
}

fn same_limits(a: &ResourceLimits, b: &ResourceLimits) -> bool {
    a.memory_mb == b.memory_mb && a.pids == b.pids && a.cpus == b.cpus && a.tmpfs_mb == b.tmpfs_mb
}

impl Pool {
    /// A pool keeping `size` VMs per image, their directories under `vms_dir`.
    pub fn new(size: usize, vms_dir: PathBuf) -> Pool {
        Pool {
            inner: Arc::new(Inner {
                size,
                vms_dir,
                seq: AtomicU64::new(0),
                idle: Mutex::new(HashMap::new()),
                booting: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The configured size per image.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// Idle VMs, all images together.
    pub fn idle(&self) -> usize {
        self.inner
            .idle
            .lock()
            .map(|m| m.values().map(Vec::len).sum())
            .unwrap_or(0)
    }

    fn next_dir(&self) -> PathBuf {
        let n = self.inner.seq.fetch_add(1, Ordering::SeqCst);
        self.inner
            .vms_dir
            .join(format!("vm-{}-{n}", std::process::id()))
    }

    /// Boots one VM from `template` in a fresh directory. A guest that fails before it
    /// says it is ready (no job code has run in it yet) is booted again in another
    /// directory, after a pause that grows with each try, up to [`BOOT_ATTEMPTS`] in all:
    /// under TCG the guest's init has been seen to die at boot, several times in a row in
    /// one node, in abort's last resort before its `main` (the likely cause, an init given
    /// no console and a root without `/dev/null`, is closed in [`super::rootfs`]; the
    /// console, with the faulting registers, is logged).
    pub async fn boot(&self, template: &Template) -> Result<Vm, VmError> {
        let mut attempt = 1;
        loop {
            let mut l = template.clone();
            l.dir = self.next_dir();
            match l.boot().await {
                Err(VmError::Boot(why)) if attempt < BOOT_ATTEMPTS => {
                    tracing::warn!(reason = %why, attempt, "microvm guest failed to boot; booting another");
                    tokio::time::sleep(BOOT_RETRY_PAUSE * attempt).await;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// A VM for `image` with `template`'s limits: a waiting one, or a new one. Starts a
    /// refill either way. The bool says whether it was warm.
    pub async fn claim(&self, image: &str, template: &Template) -> Result<(Vm, bool), VmError> {
        let warm = {
            let mut idle = self.inner.idle.lock().ok();
            let list = idle.as_mut().and_then(|m| m.get_mut(image));
            let mut found = None;
            if let Some(list) = list {
                while let Some(mut vm) = list.pop() {
                    if vm.alive() && same_limits(&vm.limits, &template.limits) {
                        found = Some(vm);
                        break;
                    }
                }
            }
            found
        };
        self.refill(image, template);
        match warm {
            Some(vm) => Ok((vm, true)),
            None => Ok((self.boot(template).await?, false)),
        }
    }

    /// Boots VMs in the background until `image` has `size` waiting (or booting).
    pub fn refill(&self, image: &str, template: &Template) {
        let want = {
            let idle = self
                .inner
                .idle
                .lock()
                .map(|m| m.get(image).map_or(0, Vec::len))
                .unwrap_or(0);
            let Ok(mut booting) = self.inner.booting.lock() else {
                return;
            };
            let b = booting.entry(image.to_string()).or_insert(0);
            let want = self.inner.size.saturating_sub(idle + *b);
            *b += want;
            want
        };
        for _ in 0..want {
            let (pool, image, template) = (self.clone(), image.to_string(), template.clone());
            tokio::spawn(async move {
                let booted = pool.boot(&template).await;
                if let Ok(mut b) = pool.inner.booting.lock() {
                    if let Some(n) = b.get_mut(&image) {
                        *n = n.saturating_sub(1);
                    }
                }
                match booted {
                    Ok(vm) => {
                        tracing::info!(
                            image,
                            boot_ms = vm.boot.as_millis() as u64,
                            "microvm ready in the pool"
                        );
                        if let Ok(mut idle) = pool.inner.idle.lock() {
                            idle.entry(image).or_default().push(vm);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(image, error = %e, "microvm pool boot failed");
                        // Do not spin on a broken setup: the next claim retries.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            });
        }
    }

    /// Destroys every waiting VM.
    pub fn drain(&self) -> usize {
        let vms: Vec<Vm> = self
            .inner
            .idle
            .lock()
            .map(|mut m| m.drain().flat_map(|(_, v)| v).collect())
            .unwrap_or_default();
        vms.len()
    }
}
