//! `GET /metrics`: the node's load and its disk-volume pool in Prometheus' text format,
//! behind the bearer token like every route but the health checks (the counts say how busy
//! a node is, which is the operator's business, not the network's).

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::response::IntoResponse;

use crate::node::Node;

pub(super) async fn metrics(State(node): State<Arc<Node>>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        render(&node),
    )
}

fn render(node: &Node) -> String {
    let c = node.capacity();
    let kernel = matches!(
        crate::loopfs::enforcement(),
        crate::loopfs::Enforcement::Kernel
    );
    let mut out = String::new();
    let gauges: [(&str, &str, u64); 6] = [
        ("jobs_running", "jobs in a sandbox now", c.running),
        (
            "jobs_queued",
            "jobs admitted and waiting for a slot",
            c.queued,
        ),
        (
            "jobs_max_running",
            "the node's limit of jobs at once",
            c.max_running,
        ),
        (
            "jobs_max_queued",
            "the node's limit of waiting jobs",
            c.max_queued,
        ),
        ("ready", "1 when /readyz answers ready", u64::from(c.ready)),
        (
            "disk_limit_kernel_enforced",
            "1 when sandboxes get loop volumes, 0 when the poller is the fallback",
            u64::from(kernel),
        ),
    ];
    for (name, help, v) in gauges {
        let _ = write!(
            out,
            "# HELP cynode_worker_{name} {help}\n# TYPE cynode_worker_{name} gauge\ncynode_worker_{name}{{backend=\"{}\"}} {v}\n",
            c.backend
        );
    }
    node.backend.write_metrics(&c.backend, &mut out);
    out.push_str(&crate::loopfs::metrics_text());
    out
}
