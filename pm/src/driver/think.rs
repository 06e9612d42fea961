//! Think: ask the model for the next reply (with the session's state, the feedback of
//! the last turn and the turn's rules), retry or fail on garbage, and journal the
//! accepted reply with the move to `Act` in one save.

use cynode_protocol::llm::LlmOutput;
use serde_json::{json, Value};

use crate::llm::{self, LlmError};
use crate::session::{FailureKind, Phase, SessionRecord};

use super::{failpoint, DriverError, Pm, Progress};

impl Pm {
    pub(super) async fn think(
        &self,
        rec: &mut SessionRecord,
        version: i64,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(), DriverError> {
        if let Some(why) = self.over_budget(rec) {
            rec.fail(FailureKind::BudgetExhausted, why);
            self.store.save(rec, version, &[]).await?;
            return Ok(());
        }
        progress(Progress::Turn(rec.turn));
        // A reply this turn already got (journaled before a crash) is never asked again.
        let stored = self
            .store
            .last_journal(&rec.state.session_id, "model_reply")
            .await?
            .filter(|e| e.data["turn"] == json!(rec.turn));
        let reply: LlmOutput =
            match stored.and_then(|e| serde_json::from_value(e.data["reply"].clone()).ok()) {
                Some(r) => r,
                None => {
                    let task_ids: Vec<String> =
                        rec.state.plan.iter().map(|p| p.task_id.clone()).collect();
                    let rules = llm::TurnRules::for_session(rec, &self.contract.catalog);
                    let schema = rules.schema(&self.contract.catalog, &task_ids);
                    let mut feedback = feedback_text(rec);
                    if let Some(notice) = &rules.notice {
                        let joined = feedback.map_or_else(String::new, |f| f + "\n");
                        feedback = Some(joined + notice);
                    }
                    match self
                        .llm
                        .next_reply_with(
                            &llm::compose_context(
                                &self.contract.system_prompt,
                                &rec.state.objective,
                                &state_summary(rec),
                                feedback.as_deref(),
                            ),
                            &schema,
                            &self.contract.validator,
                            &task_ids,
                            // A final must leave no task open (run, or skipped with a reason).
                            |r| {
                                rules.check(r)?;
                                llm::contract::check_final_closes_plan(rec, r)
                            },
                        )
                        .await
                    {
                        Ok((reply, raw, attempts)) => {
                            rec.phase = Phase::Act {
                                reply: reply.clone(),
                            };
                            rec.feedback.clear();
                            rec.event(
                            "model_reply",
                            json!({ "turn": rec.turn, "type": reply.kind, "attempts": attempts }),
                        );
                            self.store
                                .save(
                                    rec,
                                    version,
                                    &[(
                                        "model_reply",
                                        json!({ "turn": rec.turn, "raw": raw, "reply": reply }),
                                    )],
                                )
                                .await?;
                            failpoint("after_model_reply");
                            return Ok(());
                        }
                        Err(e) => {
                            let kind = match &e {
                                LlmError::ModelContractViolation { .. } => {
                                    FailureKind::ModelContractViolation
                                }
                                _ => FailureKind::ModelUnavailable,
                            };
                            rec.fail(kind, e.to_string());
                            self.store.save(rec, version, &[]).await?;
                            return Ok(());
                        }
                    }
                }
            };
        rec.phase = Phase::Act { reply };
        self.store.save(rec, version, &[]).await?;
        Ok(())
    }
}

/// How many of the session's artifacts the model is shown each turn (the rest are
/// counted: `"… N more"`).
pub(super) const MAX_ARTIFACTS_SHOWN: usize = 50;

pub(super) fn state_summary(rec: &SessionRecord) -> Value {
    let all = &rec.state.artifacts;
    let mut artifacts: Vec<Value> = all
        .iter()
        .take(MAX_ARTIFACTS_SHOWN)
        .map(|a| json!({ "path": a.record.path, "sha256": a.record.sha256 }))
        .collect();
    if all.len() > MAX_ARTIFACTS_SHOWN {
        artifacts.push(json!(format!("… {} more", all.len() - MAX_ARTIFACTS_SHOWN)));
    }
    json!({
        "plan": rec.state.plan,
        "notes": rec.state.notes,
        "artifacts": artifacts,
        "turn": rec.turn,
        "jobs_dispatched": rec.jobs_dispatched,
        "budgets": rec.budgets,
    })
}
pub(super) fn feedback_text(rec: &SessionRecord) -> Option<String> {
    (!rec.feedback.is_empty()).then(|| rec.feedback.join("\n"))
}

#[cfg(test)]
mod tests {
    use cynode_protocol::result::ArtifactRecord;
    use cynode_protocol::session::SessionArtifact;

    use super::*;

    #[test]
    fn the_model_is_shown_at_most_50_artifacts_and_a_count() {
        let mut rec = SessionRecord::new("s-1", "default", "o", Default::default());
        for i in 0..1000 {
            rec.state.artifacts.push(SessionArtifact {
                record: ArtifactRecord {
                    path: format!("p{i}"),
                    sha256: "0".repeat(64),
                    size_bytes: 1,
                },
                job_id: "j1".into(),
                location: "x".into(),
            });
        }
        let v = state_summary(&rec);
        let shown = v["artifacts"].as_array().unwrap();
        assert_eq!(shown.len(), MAX_ARTIFACTS_SHOWN + 1);
        assert_eq!(shown[0]["path"], "p0");
        assert_eq!(shown[MAX_ARTIFACTS_SHOWN], "… 950 more");
    }
}
