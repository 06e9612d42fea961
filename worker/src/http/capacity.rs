//! `GET /v1/worker/capacity`: the node's limits and current load, for PMs spreading jobs.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use cynode_protocol::worker_api::WorkerCapacity;

use crate::node::Node;

pub(super) async fn capacity(State(node): State<Arc<Node>>) -> Json<WorkerCapacity> {
    Json(node.capacity())
}
