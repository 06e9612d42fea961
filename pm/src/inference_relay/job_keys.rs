//! The relay's per-job keys: what the local worker presents for one job's inference
//! requests. The PM mints one when it dispatches a job while a relay serves in this
//! process ([`job_key`]), sends it in the job's Worker API request (`inference_key`,
//! never job.json), and revokes it when the job ends (the returned [`KeyGuard`], on
//! drop). A key admits nothing after its deadline (the job's runtime plus a grace) even
//! if no guard revoked it. Keys are compared in constant time; none is ever logged.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use cynode_protocol::worker_api::{
    JobKey, RunJobRequest, DEFAULT_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS,
};
use secrecy::{ExposeSecret, SecretString};
use subtle::ConstantTimeEq;

/// The live keys, by job id, with their deadlines.
#[derive(Default)]
pub struct JobKeys {
    by_job: Mutex<HashMap<String, (SecretString, Instant)>>,
}

/// Relays serving in this process: keys are minted only while one does.
static SERVING: AtomicUsize = AtomicUsize::new(0);

/// This process's keys (shared by every relay and address it serves).
pub fn keys() -> &'static JobKeys {
    static K: OnceLock<JobKeys> = OnceLock::new();
    K.get_or_init(JobKeys::default)
}

/// A relay started serving; [`stopped`] when it ends.
pub(super) fn started() {
    SERVING.fetch_add(1, Ordering::SeqCst);
}

pub(super) fn stopped() {
    SERVING.fetch_sub(1, Ordering::SeqCst);
}

/// A fresh key: 256 random bits, hex.
fn new_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

impl JobKeys {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (SecretString, Instant)>> {
        self.by_job.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `given` is a live key; expired keys are dropped on the way.
    pub(super) fn admits(&self, given: &str) -> bool {
        let now = Instant::now();
        let mut map = self.lock();
        map.retain(|_, (_, deadline)| *deadline > now);
        // Every live key is compared, whatever matched first: the time taken says nothing
        // of which key, or how much of one, matched.
        map.values().fold(false, |hit, (key, _)| {
            let want = key.expose_secret().as_bytes();
            let same = given.len() == want.len() && bool::from(given.as_bytes().ct_eq(want));
            hit | same
        })
    }

    /// Revokes `job_id`'s key.
    pub fn revoke(&self, job_id: &str) {
        self.lock().remove(job_id);
    }
}

/// Revokes its job's key when dropped (the job ended, or its driver went away).
#[derive(Debug)]
pub struct KeyGuard {
    job_id: String,
}

impl Drop for KeyGuard {
    fn drop(&mut self) {
        keys().revoke(&self.job_id);
    }
}

/// When a relay serves in this process: a fresh key for `job_id` (a re-dispatch replaces
/// the job's earlier one), valid for `ttl` unless its guard revokes it first. None when
/// no relay serves: the job's worker has an upstream of its own.
pub fn job_key(job_id: &str, ttl: Duration) -> Option<(JobKey, KeyGuard)> {
    if SERVING.load(Ordering::SeqCst) == 0 {
        return None;
    }
    let token = new_token();
    keys().lock().insert(
        job_id.to_string(),
        (SecretString::from(token.clone()), Instant::now() + ttl),
    );
    Some((
        JobKey(token),
        KeyGuard {
            job_id: job_id.to_string(),
        },
    ))
}

/// Beyond the job's own runtime, how long its key may outlive a PM that never saw the
/// job end (queueing, start-up): the deadline that bounds it.
const GRACE: Duration = Duration::from_secs(600);

/// [`job_key`] for the job of `req` (whose job.json is `job_json`), put in its
/// `inference_key`: valid for the job's runtime (its `max_runtime_seconds`, or the Worker
/// API default) plus [`GRACE`], unless the returned guard revokes it first.
pub fn for_request(job_json: &str, req: &mut RunJobRequest) -> Option<KeyGuard> {
    let runtime = serde_json::from_str::<serde_json::Value>(job_json)
        .ok()
        .and_then(|j| j["constraints"]["max_runtime_seconds"].as_u64())
        .unwrap_or(DEFAULT_TIMEOUT_SECONDS)
        .min(MAX_TIMEOUT_SECONDS);
    let ttl = Duration::from_secs(runtime) + GRACE;
    let (key, guard) = job_key(&req.job_id, ttl)?;
    req.inference_key = Some(key);
    Some(guard)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_admits_until_revoked_or_expired() {
        started();
        let (k, guard) = job_key("jk-1", Duration::from_secs(60)).unwrap();
        assert!(keys().admits(&k.0));
        assert!(!keys().admits(&k.0[1..]));
        assert!(!keys().admits(""));
        drop(guard);
        assert!(!keys().admits(&k.0), "revoked with its guard");
        let (k, _guard) = job_key("jk-2", Duration::from_millis(1)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(!keys().admits(&k.0), "expired");
        stopped();
    }
}
