//! What one turn of the loop asks of the model: the parts that depend only on the skill
//! catalog, built once per process ([`Contract`]: the catalog, the compiled
//! [`ReplyValidator`], the system prompt), and the per-turn rules ([`TurnRules`]) that
//! narrow the reply types a turn accepts.
//!
//! The turn rules narrow the reply types a turn's response schema offers, so a
//! grammar-constrained backend can only produce a reply the loop can use (small local
//! models otherwise ask questions nobody answers, finish before doing anything, or plan
//! forever); the validator enforces the same rules for backends without constrained
//! decoding, and the model is told why ([`TurnRules::notice`]):
//! - without a person to answer (`run --non-interactive`, or stdin not a terminal),
//!   `message` is never offered;
//! - `final` is offered once a job of the session was attempted;
//! - after `Budgets::max_plan_only_streak` (default [`MAX_PLAN_ONLY_STREAK`]) plan-only
//!   replies in a row, `plan_update` is left out until the model acts.

use cynode_protocol::llm::{LlmOutput, LlmOutputType};
use cynode_protocol::session::TaskStatus;
use serde_json::{json, Value};

use super::contract::{response_schema, response_schema_for, ContractError, REPLY_TYPES};
use super::prompt::system_prompt;
use super::ReplyValidator;

use crate::session::SessionRecord;
use crate::skills::registry::CatalogEntry;

pub use crate::session::MAX_PLAN_ONLY_STREAK;

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
    /// The sha256 of the session's verified artifacts: the only values a `final` reply's
    /// `artifacts` may list (the schema enumerates them, so a grammar-constrained model
    /// cannot invent one; none yet means an empty list).
    pub artifacts: Vec<String>,
    /// This turn's only job is this `first_look` skill with its default inputs (an
    /// autonomous session's first turn, when the catalog has such a skill).
    pub first_look: Option<String>,
}

/// What [`TurnRules`] decides from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Facts {
    /// A person can answer a `message`.
    interactive: bool,
    /// A job of this session was attempted (run, denied by policy, or refused).
    acted: bool,
    /// The plan has a task that is not done (or no task yet).
    open_task: bool,
    /// `plan_update` replies in a row, most recent last.
    plan_streak: usize,
    /// The limit of that streak (0: no limit).
    plan_limit: usize,
}

impl TurnRules {
    /// The rules for the session's next turn, from its history of replies.
    /// `catalog`: the skills offered (none: `final` is never withheld).
    pub fn for_session(rec: &SessionRecord, catalog: &[CatalogEntry]) -> Self {
        let can_act = !catalog.is_empty();
        let plan_streak = rec
            .state
            .history
            .iter()
            .rev()
            .filter(|e| e.kind == "model_reply")
            .take_while(|e| e.data["type"] == "plan_update")
            .count();
        let mut rules = Self::decide(Facts {
            interactive: rec.interactive,
            acted: !can_act || !rec.attempts.is_empty(),
            open_task: rec.state.plan.is_empty()
                || rec.state.plan.iter().any(|p| p.status != TaskStatus::Done),
            plan_streak,
            // Autonomous: one plan_update, then act or finish (SmolLM2-135M otherwise
            // spent the streak's three turns restating that the plan is done).
            plan_limit: match rec.budgets.max_plan_only_streak as usize {
                0 => 0,
                n if rec.interactive => n,
                _ => 1,
            },
        });
        if !rec.interactive && rules.kinds == ["job_request"] {
            rules.first_look = catalog
                .iter()
                .find(|c| c.first_look)
                .map(|c| c.skill_id.clone());
        }
        rules.artifacts = rec
            .state
            .artifacts
            .iter()
            .map(|a| a.record.sha256.clone())
            .collect();
        rules
    }

    /// The rules of a new session's first turn.
    pub fn first_turn(interactive: bool) -> Self {
        Self::decide(Facts {
            interactive,
            acted: false,
            open_task: true,
            plan_streak: 0,
            plan_limit: 0,
        })
    }

    /// With a person to answer (interactive), the person steers: every reply type is
    /// offered, but for the plan-only streak. Without one (autonomous), the loop keeps the
    /// model on the path that ends in a result:
    /// - `message` is never offered: a question would park the session for nobody;
    /// - the first turn acts: `plan_update` and `final` are offered once a job was
    ///   attempted (the first job_request writes the plan in its own state_patch; a
    ///   deliverable rests on a job result; a session that cannot act at all still ends,
    ///   by its budgets);
    /// - `job_request` only while the plan has a task that is not done: once every task
    ///   is done, the model adds a task or finishes (a job for a done task repeats work).
    ///
    /// In both, `plan_update` is not offered after `plan_limit` of them in a row
    /// (`Budgets::max_plan_only_streak`; 1 when autonomous, 0 turns the guard off).
    fn decide(f: Facts) -> Self {
        let mut notices = Vec::new();
        let mut kinds: Vec<&'static str> = REPLY_TYPES.to_vec();
        if !f.interactive {
            kinds.retain(|k| *k != "message");
            if !f.acted {
                kinds.retain(|k| *k != "final" && *k != "plan_update");
                notices.push(
                    "No job has run yet: this turn runs one (job_request) that looks at the \
                     workspace, its state_patch adding the plan entry it works on. final is \
                     accepted once a job result shows the work."
                        .to_string(),
                );
            } else if !f.open_task {
                kinds.retain(|k| *k != "job_request");
                notices.push(
                    "Every task of the plan is done. If the results reach the objective, reply \
                     final now: a one-sentence summary of what the results show. Otherwise \
                     reply plan_update adding the task that is missing."
                        .to_string(),
                );
            }
        }
        if f.plan_limit > 0 && f.plan_streak >= f.plan_limit {
            kinds.retain(|k| *k != "plan_update");
            notices.push(format!(
                "You replied plan_update {} times in a row. This turn you must act: reply {}.",
                f.plan_streak,
                kinds
                    .iter()
                    .map(|k| match *k {
                        "job_request" => "job_request to run a skill for a task",
                        "message" => "message to ask the user",
                        "final" => "final when the objective is met",
                        other => other,
                    })
                    .collect::<Vec<_>>()
                    .join(", or ")
            ));
        }
        TurnRules {
            kinds,
            notice: (!notices.is_empty()).then(|| notices.join("\n")),
            artifacts: Vec::new(),
            first_look: None,
        }
    }

    /// The response schema of this turn.
    pub fn schema(&self, catalog: &[CatalogEntry], task_ids: &[String]) -> Value {
        let look: Vec<CatalogEntry> = catalog
            .iter()
            .filter(|c| Some(&c.skill_id) == self.first_look.as_ref())
            .map(|c| CatalogEntry {
                inputs_schema: json!({ "type": "object", "additionalProperties": false,
                                       "properties": {} }),
                ..c.clone()
            })
            .collect();
        let offered = if look.is_empty() { catalog } else { &look };
        let mut schema = response_schema_for(offered, task_ids, &self.kinds);
        // An empty `enum` is no grammar at all for some engines: no artifact, no item.
        let list = match self.artifacts.is_empty() {
            true => json!({ "type": "array", "maxItems": 0 }),
            false => json!({ "type": "array", "maxItems": self.artifacts.len(),
                             "items": { "type": "string", "enum": self.artifacts } }),
        };
        if let Some(variants) = schema["anyOf"].as_array_mut() {
            for v in variants {
                if v["properties"]["type"]["const"] == "final" {
                    v["properties"]["payload"]["properties"]["artifacts"] = list.clone();
                }
            }
        }
        schema
    }

    /// Rejects a reply of a type this turn does not accept, or a `final` listing an
    /// artifact the session does not have (for backends that do not constrain decoding to
    /// the schema).
    pub fn check(&self, reply: &LlmOutput) -> Result<(), ContractError> {
        let kind = kind_name(reply.kind);
        if !self.kinds.contains(&kind) {
            return Err(ContractError::Invalid {
                path: "type".into(),
                message: format!(
                    "`{kind}` is not accepted this turn; reply one of {}",
                    self.kinds.join(", ")
                ),
            });
        }
        if let Some(look) = &self.first_look {
            let (skill, inputs) = (&reply.payload["skill_id"], &reply.payload["inputs"]);
            if skill != look.as_str() || inputs != &json!({}) {
                return Err(ContractError::Invalid {
                    path: "payload".into(),
                    message: format!(
                        "the first job looks at the workspace: skill_id `{look}` with inputs {{}}"
                    ),
                });
            }
        }
        if let Some(listed) = reply.payload.get("artifacts").and_then(Value::as_array) {
            if let Some((i, bad)) = listed.iter().enumerate().find(|(_, a)| {
                !a.as_str()
                    .is_some_and(|a| self.artifacts.iter().any(|k| k == a))
            }) {
                return Err(ContractError::Invalid {
                    path: format!("payload.artifacts[{i}]"),
                    message: format!(
                        "{bad} is not the sha256 of an artifact of this session; list only \
                         these: [{}]",
                        self.artifacts.join(", ")
                    ),
                });
            }
        }
        Ok(())
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

    fn cat() -> Vec<CatalogEntry> {
        ["repo-inspect", "search-code"]
            .iter()
            .map(|id| CatalogEntry {
                skill_id: id.to_string(),
                version: "1.0.0".into(),
                description: "d".into(),
                inputs_schema: json!({ "type": "object", "properties": { "path": { "type": "string" } } }),
                first_look: *id == "repo-inspect",
            })
            .collect()
    }

    fn with_replies(kinds: &[&str]) -> SessionRecord {
        let mut rec = SessionRecord::new("s-1", "t", "objective", Budgets::default());
        for (turn, k) in kinds.iter().enumerate() {
            rec.event("model_reply", json!({ "turn": turn, "type": k }));
            rec.event("job_result", json!({}));
            if *k == "job_request" {
                rec.attempts.insert(format!("t{turn}"), 1);
            }
        }
        rec
    }

    #[test]
    fn plan_update_is_dropped_after_a_streak_and_comes_back_after_acting() {
        let fresh = TurnRules::for_session(&with_replies(&[]), &cat());
        assert_eq!(fresh.kinds, REPLY_TYPES.to_vec());
        assert_eq!(fresh.notice, None);
        let two = TurnRules::for_session(&with_replies(&["plan_update", "plan_update"]), &cat());
        assert!(two.kinds.contains(&"plan_update"));
        let three = TurnRules::for_session(&with_replies(&["plan_update"; 3]), &cat());
        assert_eq!(three.kinds, vec!["job_request", "message", "final"]);
        assert!(three.notice.as_deref().unwrap().contains("3 times"));
        let acted = TurnRules::for_session(
            &with_replies(&["plan_update", "plan_update", "plan_update", "job_request"]),
            &cat(),
        );
        assert_eq!(acted.kinds, REPLY_TYPES.to_vec());
        assert_eq!(acted.notice, None);
        let mut off = with_replies(&["job_request", "plan_update", "plan_update", "plan_update"]);
        off.budgets.max_plan_only_streak = 0;
        assert_eq!(
            TurnRules::for_session(&off, &cat()).kinds,
            REPLY_TYPES.to_vec()
        );
    }

    #[test]
    fn nobody_to_answer_means_act_first_finish_on_evidence_and_never_ask() {
        let autonomous = |kinds: &[&str]| {
            let mut rec = with_replies(kinds);
            rec.interactive = false;
            rec
        };
        let first = TurnRules::for_session(&autonomous(&[]), &cat());
        assert_eq!(first.kinds, vec!["job_request"]);
        assert!(first
            .notice
            .as_deref()
            .unwrap()
            .contains("No job has run yet"));
        assert_eq!(first.kinds, TurnRules::first_turn(false).kinds);
        // Its one job is the first-look skill with its defaults.
        assert_eq!(first.first_look.as_deref(), Some("repo-inspect"));
        let schema = first.schema(&cat(), &[]);
        let job = &schema["anyOf"][0]["properties"]["payload"];
        assert_eq!(job["properties"]["skill_id"]["const"], "repo-inspect");
        assert_eq!(job["properties"]["inputs"]["properties"], json!({}));
        let reply = |skill: &str, inputs: Value| -> LlmOutput {
            serde_json::from_value(json!({"type": "job_request", "state_patch": [],
                "payload": {"task_id": "t1", "skill_id": skill, "inputs": inputs}}))
            .unwrap()
        };
        assert!(first.check(&reply("repo-inspect", json!({}))).is_ok());
        for bad in [
            reply("search-code", json!({})),
            reply("repo-inspect", json!({"path": "x"})),
        ] {
            assert!(first
                .check(&bad)
                .unwrap_err()
                .to_string()
                .contains("first job looks"));
        }
        assert_eq!(TurnRules::first_turn(true).kinds, REPLY_TYPES.to_vec());
        // A catalog without skills cannot act: final is never withheld, so a turn always
        // has a reply type its schema can offer.
        let none = TurnRules::for_session(&autonomous(&["plan_update"; 3]), &[]);
        assert_eq!(none.kinds, vec!["job_request", "final"]);
        // After a job: plan, act on an open task, or finish; never ask.
        let mut open = autonomous(&["job_request"]);
        open.state.plan = vec![serde_json::from_value(
            json!({ "task_id": "t0", "description": "d", "status": "pending", "version": 1 }),
        )
        .unwrap()];
        assert_eq!(
            TurnRules::for_session(&open, &cat()).kinds,
            vec!["plan_update", "job_request", "final"]
        );
        // One plan_update in a row, then act or finish.
        let mut planned = autonomous(&["job_request", "plan_update"]);
        planned.state.plan = open.state.plan.clone();
        assert_eq!(
            TurnRules::for_session(&planned, &cat()).kinds,
            vec!["job_request", "final"]
        );
        // Every task done: add a task or finish.
        open.state.plan[0].status = TaskStatus::Done;
        let done = TurnRules::for_session(&open, &cat());
        assert_eq!(done.kinds, vec!["plan_update", "final"]);
        assert!(done.notice.unwrap().contains("reply final now"));
    }

    #[test]
    fn a_final_may_list_only_the_sessions_artifacts() {
        let mut rec = with_replies(&["job_request"]);
        let sha = "a".repeat(64);
        rec.state.artifacts = vec![serde_json::from_value(json!({
            "path": "out.txt", "sha256": sha, "size_bytes": 1, "job_id": "j", "location": "/x",
        }))
        .unwrap()];
        let rules = TurnRules::for_session(&rec, &cat());
        let schema = rules.schema(&[], &[]);
        let fin = schema["anyOf"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["properties"]["type"]["const"] == "final")
            .unwrap();
        assert_eq!(
            fin["properties"]["payload"]["properties"]["artifacts"]["items"]["enum"],
            json!([sha])
        );
        let reply = |a: Value| -> LlmOutput {
            serde_json::from_value(json!({"type": "final", "state_patch": [],
                "payload": {"summary": "s", "artifacts": a}}))
            .unwrap()
        };
        assert!(rules.check(&reply(json!([sha]))).is_ok());
        let err = rules.check(&reply(json!(["b".repeat(64)]))).unwrap_err();
        assert!(err.to_string().contains("payload.artifacts[0]"), "{err}");
        // No artifact yet: an empty list is all a grammar allows.
        let empty = TurnRules::for_session(&with_replies(&[]), &cat()).schema(&[], &[]);
        assert!(empty.to_string().contains("\"maxItems\":0"));
    }

    #[test]
    fn the_narrowed_schema_and_check_agree() {
        let rules = TurnRules::for_session(&with_replies(&["plan_update"; 3]), &[]);
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
