//! The PM's interface to the model (design.md §3.5): the output contract as a JSON Schema
//! built from the live skill registry, the validator that checks every reply against it,
//! the system prompt and context composition, and the OpenAI-compatible client that asks
//! for a reply and retries until it gets a valid one.
//!
//! - [`contract`]: [`response_schema`] and [`validate_reply`] / [`ReplyValidator`].
//! - [`prompt`]: [`system_prompt`] and [`compose_context`].
//! - [`client`]: [`ModelConfig`] and [`LlmClient`] (async-openai underneath).
//! - [`key_order`]: [`KeyOrdered`], the reply's key order in every request body.
//! - [`turn`]: [`Contract`] (compiled once per catalog) and [`TurnRules`] (the progress
//!   guard that narrows a turn's reply types).
//!
//! Role separation: instructions live only in the system message; the objective, the
//! session state and results go in a user message as data; the model's own messages are
//! replies in the contract, nothing else.

pub mod client;
pub mod contract;
pub mod key_order;
pub mod prompt;
pub mod turn;

use serde::{Deserialize, Serialize};

pub use client::{LlmClient, LlmError, ModelConfig, API_KEY_ENV, TRANSPORT_TRIES};
pub use contract::{
    response_schema, response_schema_for, validate_reply, ContractError, ReplyValidator,
    PATCH_PATH_PATTERN, RESPONSE_SCHEMA_NAME,
};
pub use key_order::{ordered_json, KeyOrdered};
pub use prompt::{compose_context, contract_feedback, describe_schema, system_prompt};
pub use turn::{Contract, TurnRules, MAX_PLAN_ONLY_STREAK};

/// Who wrote a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The PM's instructions (only [`system_prompt`] goes here).
    System,
    /// Data for the model: objective, state, results, feedback on a rejected reply.
    User,
    /// A reply of the model.
    Assistant,
}

/// One message of the conversation sent to the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
}

impl ChatMessage {
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self {
            role: Role::System,
            content: content.into(),
        }
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: Role::User,
            content: content.into(),
        }
    }

    /// An assistant message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self {
            role: Role::Assistant,
            content: content.into(),
        }
    }
}
