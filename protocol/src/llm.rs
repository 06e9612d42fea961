//! The PM's LLM output contract: what the model may answer each turn.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The four response types the model may emit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LlmOutputType {
    PlanUpdate,
    JobRequest,
    Message,
    Final,
}

/// One model reply. `payload` is typed per `type` by [`LlmOutput::typed_payload`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LlmOutput {
    #[serde(rename = "type")]
    pub kind: LlmOutputType,
    /// RFC 6902 operations, restricted by the PM to the plan and notes.
    #[serde(default)]
    pub state_patch: Vec<PatchOperation>,
    #[serde(default)]
    pub payload: serde_json::Value,
}

/// One RFC 6902 operation (kept as data here; the PM applies it with json-patch).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchOperation {
    pub op: PatchOp,
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
}

/// RFC 6902 operation names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PatchOp {
    Add,
    Remove,
    Replace,
    Move,
    Copy,
    Test,
}

/// `job_request` payload: the model picks a skill and inputs, never job.json itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobRequestPayload {
    pub task_id: String,
    pub skill_id: String,
    #[serde(default)]
    pub inputs: serde_json::Value,
}

/// `message` payload: a question for the user; the session parks until answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MessagePayload {
    pub text: String,
}

/// `final` payload: the deliverable.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FinalPayload {
    pub summary: String,
    /// sha256 references of artifacts that make up the deliverable.
    #[serde(default)]
    pub artifacts: Vec<String>,
}

/// `plan_update` payload: an optional note; the change itself is in `state_patch`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanUpdatePayload {
    #[serde(default)]
    pub note: Option<String>,
}

/// A reply's payload, typed by its `type`.
#[derive(Debug, Clone, PartialEq)]
pub enum TypedPayload {
    PlanUpdate(PlanUpdatePayload),
    JobRequest(JobRequestPayload),
    Message(MessagePayload),
    Final(FinalPayload),
}

impl LlmOutput {
    /// Parses `payload` according to `type`; errors name the field under `payload`.
    pub fn typed_payload(&self) -> Result<TypedPayload, crate::ValidationError> {
        fn typed<T: serde::de::DeserializeOwned>(
            v: &serde_json::Value,
        ) -> Result<T, crate::ValidationError> {
            let v = if v.is_null() {
                serde_json::Value::Object(serde_json::Map::new())
            } else {
                v.clone()
            };
            serde_path_to_error::deserialize(v).map_err(|e| {
                let p = e.path().to_string();
                let path = if p == "." {
                    "payload".into()
                } else {
                    format!("payload.{p}")
                };
                crate::ValidationError::new(path, e.into_inner().to_string())
            })
        }
        Ok(match self.kind {
            LlmOutputType::PlanUpdate => TypedPayload::PlanUpdate(typed(&self.payload)?),
            LlmOutputType::JobRequest => TypedPayload::JobRequest(typed(&self.payload)?),
            LlmOutputType::Message => TypedPayload::Message(typed(&self.payload)?),
            LlmOutputType::Final => TypedPayload::Final(typed(&self.payload)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_request_payload_is_typed() {
        let out: LlmOutput = serde_json::from_value(serde_json::json!({
            "type": "job_request",
            "payload": { "task_id": "t1", "skill_id": "go-test", "inputs": { "pkg": "./..." } }
        }))
        .unwrap();
        assert_eq!(
            out.typed_payload().unwrap(),
            TypedPayload::JobRequest(JobRequestPayload {
                task_id: "t1".into(),
                skill_id: "go-test".into(),
                inputs: serde_json::json!({ "pkg": "./..." }),
            })
        );
    }

    #[test]
    fn bad_payload_names_field() {
        let out: LlmOutput = serde_json::from_value(serde_json::json!({
            "type": "message", "payload": { "text": 3 }
        }))
        .unwrap();
        assert_eq!(out.typed_payload().unwrap_err().path, "payload.text");
    }
}
