//! Process metrics of the PM in Prometheus' text format (prometheus-client), served by
//! `cynode-pm serve` at `/metrics`.
//!
//! One process-wide registry ([`metrics`]): the loop, the model client and the service
//! record into it wherever the event happens, so there is no plumbing through every call.
//! Session counts by status are read from the database at scrape time (they are shared by
//! every replica); everything else is this process's own.

use std::sync::OnceLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A label set with one `outcome` (or `status`, `kind`) value.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: String,
}

/// Sessions by status (set at scrape time from the database).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    pub status: String,
}

/// A worker of the registry.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    pub worker: String,
}

/// Every metric of the process.
pub struct Metrics {
    registry: Registry,
    pub sessions: Family<StatusLabel, Gauge>,
    pub model_calls: Family<Outcome, Counter>,
    pub model_latency: Histogram,
    pub prompt_tokens: Counter,
    pub completion_tokens: Counter,
    pub jobs: Family<Outcome, Counter>,
    pub policy_denials: Counter,
    pub artifact_integrity_failures: Counter,
    /// Sessions this replica is driving right now.
    pub active_sessions: Gauge,
    /// Runnable sessions no replica has claimed yet (set at scrape time).
    pub queue_depth: Gauge,
    /// Sessions whose workspace this process placed, by worker.
    pub placements: Family<WorkerLabel, Counter>,
    /// 1 when the worker answered its last probe ready, 0 when it is skipped.
    pub worker_up: Family<WorkerLabel, Gauge>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// The process-wide metrics.
pub fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let mut registry = Registry::with_prefix("cynode_pm");
        let m = Metrics {
            sessions: Family::default(),
            model_calls: Family::default(),
            model_latency: Histogram::new(exponential_buckets(0.005, 2.0, 16)),
            prompt_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            jobs: Family::default(),
            policy_denials: Counter::default(),
            artifact_integrity_failures: Counter::default(),
            active_sessions: Gauge::default(),
            queue_depth: Gauge::default(),
            placements: Family::default(),
            worker_up: Family::default(),
            registry: Registry::default(),
        };
        registry.register("sessions", "Sessions by status", m.sessions.clone());
        registry.register(
            "model_calls",
            "Model calls by outcome (ok, error)",
            m.model_calls.clone(),
        );
        registry.register(
            "model_latency_seconds",
            "Latency of one model call",
            m.model_latency.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens the model reported",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "completion_tokens",
            "Completion tokens the model reported",
            m.completion_tokens.clone(),
        );
        registry.register(
            "jobs",
            "Jobs by outcome (the worker's status)",
            m.jobs.clone(),
        );
        registry.register(
            "policy_denials",
            "Jobs the policy gate denied",
            m.policy_denials.clone(),
        );
        registry.register(
            "artifact_integrity_failures",
            "Artifacts whose bytes did not match result.json's sha256",
            m.artifact_integrity_failures.clone(),
        );
        registry.register(
            "active_sessions",
            "Sessions this replica is driving",
            m.active_sessions.clone(),
        );
        registry.register(
            "queue_depth",
            "Runnable sessions no replica has claimed",
            m.queue_depth.clone(),
        );
        registry.register(
            "placements",
            "Sessions whose workspace (and so every job) went to the worker",
            m.placements.clone(),
        );
        registry.register(
            "worker_up",
            "Whether the worker answered its last probe ready (1) or is skipped (0)",
            m.worker_up.clone(),
        );
        Metrics { registry, ..m }
    })
}

impl Metrics {
    /// One model call: its outcome, latency and reported tokens.
    pub fn model_call(&self, ok: bool, elapsed: Duration, prompt: u64, completion: u64) {
        let outcome = if ok { "ok" } else { "error" };
        self.model_calls
            .get_or_create(&Outcome {
                outcome: outcome.into(),
            })
            .inc();
        self.model_latency.observe(elapsed.as_secs_f64());
        self.prompt_tokens.inc_by(prompt);
        self.completion_tokens.inc_by(completion);
    }

    /// One finished job, by the worker's status.
    pub fn job(&self, status: &str) {
        self.jobs
            .get_or_create(&Outcome {
                outcome: status.into(),
            })
            .inc();
    }

    /// A worker's health as last probed.
    pub fn worker_up(&self, worker: &str, up: bool) {
        self.worker_up
            .get_or_create(&WorkerLabel {
                worker: worker.into(),
            })
            .set(i64::from(up));
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_values_show_in_the_exposition() {
        let m = metrics();
        m.model_call(true, Duration::from_millis(20), 7, 3);
        m.job("completed");
        m.policy_denials.inc();
        m.worker_up("w1", false);
        let text = m.encode();
        for needle in [
            "cynode_pm_model_calls_total{outcome=\"ok\"}",
            "cynode_pm_model_latency_seconds_bucket",
            "cynode_pm_jobs_total{outcome=\"completed\"}",
            "cynode_pm_policy_denials_total",
            "cynode_pm_queue_depth",
            "cynode_pm_worker_up{worker=\"w1\"} 0",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
    }
}
