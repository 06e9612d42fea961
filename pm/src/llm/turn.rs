//! What one turn of the loop asks of the model: the parts that depend only on the skill
//! catalog, built once per process ([`Contract`]: the catalog, the compiled
//! [`ReplyValidator`], the system prompt), and the per-turn rules ([`TurnRules`]) that
//! narrow the reply types a turn accepts.
//!
//! The progress guard: a model that answers `plan_update` again and again never gets
//! anything done (small local models do exactly this). After
//! `Budgets::max_plan_only_streak` (default [`MAX_PLAN_ONLY_STREAK`]) plan-only replies in
//! a row, the next turn's response schema leaves `plan_update` out,
//! so a grammar-constrained backend can only request a job, ask, or finish; the validator
//! enforces the same rule for backends without constrained decoding, and the model is
//! told why.

use cynode_protocol::llm::{LlmOutput, LlmOutputType};
use serde_json::Value;

use super::contract::{response_schema, response_schema_for, ContractError, REPLY_TYPES};
use super::prompt::system_prompt;
use super::ReplyValidator;
use crate::session::SessionRecord;
use crate::skills::registry::CatalogEntry;

/// After this many `plan_update` replies in a row, the next turn must act (the default of
/// `Budgets::max_plan_only_streak`).
pub const MAX_PLAN_ONLY_STREAK: u32 = 3;

/// The catalog-dependent parts of the contract, compiled once.
#[derive(Debug)]
pub struct Contract {
    pub catalog: Vec<CatalogEntry>,
    pub validator: ReplyValidator,
    pub system_prompt: String,
}

impl Contract {
    /// Compiles the response schema and every skill's input schema.
    pub fn new(catalog: Vec<CatalogEntry>) -> Result<Self, ContractError> {
        // Validation does not depend on the plan's task ids (they only appear in the
        // schema's descriptions); the semantic checks get them per turn.
        let validator = ReplyValidator::new(&response_schema(&catalog, &[]), &catalog)?;
        let system_prompt = system_prompt(&catalog);
        Ok(Contract {
            catalog,
            validator,
            system_prompt,
        })
    }
}

/// Which reply types this turn accepts, and why some are left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnRules {
    pub kinds: Vec<&'static str>,
    /// Told to the model when the set is narrowed.
    pub notice: Option<String>,
}

impl TurnRules {
    /// The rules for the session's next turn, from its history of replies.
    pub fn for_session(rec: &SessionRecord) -> Self {
        let streak = rec
            .state
            .history
            .iter()
            .rev()
            .filter(|e| e.kind == "model_reply")
            .take_while(|e| e.data["type"] == "plan_update")
            .count();
        let limit = rec.budgets.max_plan_only_streak as usize;
        if limit > 0 && streak >= limit {
            TurnRules {
                kinds: REPLY_TYPES
                    .iter()
                    .copied()
                    .filter(|k| *k != "plan_update")
                    .collect(),
                notice: Some(format!(
                    "You replied plan_update {streak} times in a row. This turn you must act: \
                     reply job_request to run a skill for a task, message to ask the user, or \
                     final when the objective is met."
                )),
            }
        } else {
            TurnRules {
                kinds: REPLY_TYPES.to_vec(),
                notice: None,
            }
        }
    }

    /// The response schema of this turn.
    pub fn schema(&self, catalog: &[CatalogEntry], task_ids: &[String]) -> Value {
        response_schema_for(catalog, task_ids, &self.kinds)
    }

    /// Rejects a reply of a type this turn does not accept (for backends that do not
    /// constrain decoding to the schema).
    pub fn check(&self, reply: &LlmOutput) -> Result<(), ContractError> {
        let kind = kind_name(reply.kind);
        if self.kinds.contains(&kind) {
            return Ok(());
        }
        Err(ContractError::Invalid {
            path: "type".into(),
            message: format!(
                "`{kind}` is not accepted this turn; reply one of {}",
                self.kinds.join(", ")
            ),
        })
    }
}

fn kind_name(kind: LlmOutputType) -> &'static str {
    match kind {
        LlmOutputType::PlanUpdate => "plan_update",
        LlmOutputType::JobRequest => "job_request",
        LlmOutputType::Message => "message",
        LlmOutputType::Final => "final",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::{Budgets, SessionRecord};
    use serde_json::json;

    fn with_replies(kinds: &[&str]) -> SessionRecord {
        let mut rec = SessionRecord::new("s-1", "t", "objective", Budgets::default());
        for (turn, k) in kinds.iter().enumerate() {
            rec.event("model_reply", json!({ "turn": turn, "type": k }));
            rec.event("job_result", json!({}));
        }
        rec
    }

    #[test]
    fn plan_update_is_dropped_after_a_streak_and_comes_back_after_acting() {
        let fresh = TurnRules::for_session(&with_replies(&[]));
        assert_eq!(fresh.kinds, REPLY_TYPES.to_vec());
        let two = TurnRules::for_session(&with_replies(&["plan_update", "plan_update"]));
        assert!(two.kinds.contains(&"plan_update") && two.notice.is_none());
        let three = TurnRules::for_session(&with_replies(&[
            "job_request",
            "plan_update",
            "plan_update",
            "plan_update",
        ]));
        assert!(!three.kinds.contains(&"plan_update"));
        assert!(three.notice.as_deref().unwrap().contains("3 times"));
        let acted = TurnRules::for_session(&with_replies(&[
            "plan_update",
            "plan_update",
            "plan_update",
            "job_request",
        ]));
        assert!(acted.kinds.contains(&"plan_update"));
        let mut off = with_replies(&["plan_update"; 5]);
        off.budgets.max_plan_only_streak = 0;
        assert_eq!(TurnRules::for_session(&off).kinds, REPLY_TYPES.to_vec());
    }

    #[test]
    fn the_narrowed_schema_and_check_agree() {
        let rules = TurnRules::for_session(&with_replies(&["plan_update"; 3]));
        let schema = rules.schema(&[], &[]);
        let types: Vec<&str> = schema["anyOf"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["properties"]["type"]["const"].as_str().unwrap())
            .collect();
        assert_eq!(types, vec!["message", "final"]);
        let plan_update: LlmOutput = serde_json::from_value(
            json!({"type": "plan_update", "state_patch": [], "payload": {}}),
        )
        .unwrap();
        let err = rules.check(&plan_update).unwrap_err().to_string();
        assert!(err.contains("not accepted this turn"), "{err}");
        let fin: LlmOutput = serde_json::from_value(
            json!({"type": "final", "state_patch": [], "payload": {"summary": "x"}}),
        )
        .unwrap();
        assert!(rules.check(&fin).is_ok());
    }
}
