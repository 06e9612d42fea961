//! The scripted model of the cross-binary tests: testkit's [`ScriptedModel`] (real HTTP,
//! every request recorded), answering a `final` ("script exhausted") once its script is
//! used up.

use axum::Router;
use cynode_testkit::scripted_model::{Reply, ScriptedModel};
use serde_json::Value;

/// A scripted model: answers each chat completion with the next scripted content (a JSON
/// string is sent as it is, any other value as its JSON text).
#[derive(Clone)]
pub struct Model(ScriptedModel);

impl Model {
    /// The chat completion request bodies so far, in order.
    pub fn requests(&self) -> Vec<Value> {
        self.0.chat_bodies()
    }
}

/// Starts the scripted model on 127.0.0.1 in a background thread; returns its base URL.
pub fn model_server(script: Vec<Value>) -> (String, Model) {
    let (_, m) = model_app(script);
    (m.0.serve(), m)
}

/// The scripted model's routes, for a server of the caller's own (e.g. over TLS).
pub fn model_app(script: Vec<Value>) -> (Router, Model) {
    let exhausted = Reply::Content(
        r#"{"type":"final","state_patch":[],"payload":{"summary":"script exhausted"}}"#.into(),
    );
    let m = ScriptedModel::new(script.into_iter().map(Reply::from), exhausted);
    (m.router(), Model(m))
}
