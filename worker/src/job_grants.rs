//! What a job's dispatcher hands the node for that job's use alone: the gateway's URL and
//! token ([`gateway`], used by [`crate::gateway_forward`]) and the inference upstream's
//! per-job key ([`inference_keys`], used by [`crate::inference`] when the upstream takes
//! `key_per_job`).
//!
//! - Memory only, by job id: [`Handed::take`] takes them out of the request before it is
//!   digested or stored, so neither the job store nor a log line ever holds them, and a
//!   PM that re-submits a job (after a restart, with fresh ones) is the same request.
//! - [`Handed::hold`] keeps them for a job just accepted; [`Handed::renew`] replaces
//!   those a running job already holds (a resumed PM's fresh tokens); [`forget`] drops
//!   them when the job ends.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cynode_protocol::worker_api::{GatewayGrant, JobKey, RunJobRequest};

/// One kind of grant of this node's running jobs, by job id.
pub struct Grants<T> {
    by_job: Mutex<HashMap<String, T>>,
}

impl<T> std::fmt::Debug for Grants<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grants")
            .field("jobs", &self.by_job.lock().map_or(0, |g| g.len()))
            .finish()
    }
}

impl<T> Default for Grants<T> {
    fn default() -> Self {
        Grants {
            by_job: Mutex::new(HashMap::new()),
        }
    }
}

impl<T: Clone> Grants<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, T>> {
        self.by_job.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets (or replaces) `job_id`'s grant.
    pub fn put(&self, job_id: &str, grant: T) {
        self.lock().insert(job_id.to_string(), grant);
    }

    /// Whether `job_id` has a grant.
    pub fn has(&self, job_id: &str) -> bool {
        self.lock().contains_key(job_id)
    }

    /// `job_id`'s grant, if it has one.
    pub fn get(&self, job_id: &str) -> Option<T> {
        self.lock().get(job_id).cloned()
    }

    /// Forgets `job_id`'s grant.
    pub fn remove(&self, job_id: &str) {
        self.lock().remove(job_id);
    }
}

/// The gateway grants of the node's running jobs.
pub fn gateway() -> &'static Grants<GatewayGrant> {
    static G: OnceLock<Grants<GatewayGrant>> = OnceLock::new();
    G.get_or_init(Grants::default)
}

/// The inference upstream's per-job keys of the node's running jobs.
pub fn inference_keys() -> &'static Grants<JobKey> {
    static G: OnceLock<Grants<JobKey>> = OnceLock::new();
    G.get_or_init(Grants::default)
}

/// What one request handed the node for its job.
#[derive(Debug, Default)]
pub struct Handed {
    gateway: Option<GatewayGrant>,
    inference_key: Option<JobKey>,
}

impl Handed {
    /// Takes them out of `req` (before it is digested or stored).
    pub fn take(req: &mut RunJobRequest) -> Handed {
        Handed {
            gateway: req.gateway.take(),
            inference_key: req.inference_key.take(),
        }
    }

    /// Keeps them for `job_id`, just accepted.
    pub fn hold(self, job_id: &str) {
        if let Some(g) = self.gateway {
            gateway().put(job_id, g);
        }
        if let Some(k) = self.inference_key {
            inference_keys().put(job_id, k);
        }
    }

    /// Replaces the grants `job_id` (still running) holds with these fresh ones; a kind
    /// it does not hold stays absent.
    pub fn renew(self, job_id: &str) {
        if let Some(g) = self.gateway.filter(|_| gateway().has(job_id)) {
            gateway().put(job_id, g);
        }
        if let Some(k) = self.inference_key.filter(|_| inference_keys().has(job_id)) {
            inference_keys().put(job_id, k);
        }
    }
}

/// Forgets everything `job_id` was handed (its job ended).
pub fn forget(job_id: &str) {
    gateway().remove(job_id);
    inference_keys().remove(job_id);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_renewed_only_where_held_and_forgotten() {
        let grant = |t: &str| GatewayGrant {
            url: "http://127.0.0.1:1/v1/gateway".into(),
            token: t.into(),
        };
        Handed {
            gateway: Some(grant("g1")),
            inference_key: None,
        }
        .hold("jg-1");
        Handed {
            gateway: Some(grant("g2")),
            inference_key: Some(JobKey("k2".into())),
        }
        .renew("jg-1");
        assert_eq!(gateway().get("jg-1").unwrap().token, "g2");
        assert!(!inference_keys().has("jg-1"), "renew adds no kind not held");
        forget("jg-1");
        assert!(!gateway().has("jg-1"));
        assert!(format!("{:?}", gateway()).contains("jobs"));
    }
}
