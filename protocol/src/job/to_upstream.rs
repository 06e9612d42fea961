//! A job.json for an upstream CyNodeAI worker: exactly the fields of upstream's
//! `sbajob.JobSpec`, which that worker decodes with unknown fields refused before it
//! starts the runner, and steps in upstream's form ([`super::upstream_form`]).
//!
//! Dropped, because upstream's job has no field for them: `skill_id` (informational),
//! `artifacts` (no artifact globs upstream; its runner reports what is in
//! `/job/artifacts`), `constraints.allowed_commands` and `constraints.allowed_paths` (the
//! PM's policy gate has already enforced both before dispatch; only the runner's second
//! check is lost) and `constraints.allow_overwrite` (upstream's write_file always
//! overwrites). Non-string `context.preferences` values are written as their JSON text
//! (upstream's preferences are a string map). Steps upstream cannot express are errors.

use serde_json::{json, Map, Value};

use super::upstream_form::UpstreamStep;
use super::{ExecutionMode, JobSpec};
use crate::error::{ValidationError, ValidationErrors};

impl JobSpec {
    /// This job as upstream's `sbajob.JobSpec` JSON (see the module doc); every step
    /// upstream cannot express is an error naming its field.
    pub fn to_upstream(&self) -> Result<Value, ValidationErrors> {
        let mut errs = Vec::new();
        let mut out = Map::new();
        out.insert("protocol_version".into(), json!(self.protocol_version));
        out.insert("job_id".into(), json!(self.job_id));
        out.insert("task_id".into(), json!(self.task_id));
        if let Some(mode) = self.execution_mode {
            let mode = match mode {
                ExecutionMode::DirectSteps => "direct_steps",
                ExecutionMode::AgentInference => "agent_inference",
            };
            out.insert("execution_mode".into(), json!(mode));
        }
        let c = &self.constraints;
        let mut constraints = Map::new();
        constraints.insert("max_runtime_seconds".into(), json!(c.max_runtime_seconds));
        constraints.insert("max_output_bytes".into(), json!(c.max_output_bytes));
        if c.ext_net_allowed {
            constraints.insert("ext_net_allowed".into(), json!(true));
        }
        out.insert("constraints".into(), Value::Object(constraints));
        let mut steps = Vec::with_capacity(self.steps.len());
        for (i, step) in self.steps.iter().enumerate() {
            match UpstreamStep::from_action(&step.action) {
                Ok(s) => steps.push(serde_json::to_value(s).unwrap_or(Value::Null)),
                Err(e) => errs.push(ValidationError::new(
                    format!("steps[{i}].{}", e.path),
                    e.message,
                )),
            }
        }
        if !steps.is_empty() {
            out.insert("steps".into(), Value::Array(steps));
        }
        if let Some(inf) = &self.inference {
            let mut m = Map::new();
            m.insert("allowed_models".into(), json!(inf.allowed_models));
            if let Some(src) = inf.source.as_deref().filter(|s| !s.is_empty()) {
                m.insert("source".into(), json!(src));
            }
            out.insert("inference".into(), Value::Object(m));
        }
        if let Some(ctx) = &self.context {
            let mut m = Map::new();
            let mut text = |k: &str, v: &str| {
                if !v.is_empty() {
                    m.insert(k.into(), json!(v));
                }
            };
            text("persona_title", &ctx.persona_title);
            text("persona_description", &ctx.persona_description);
            text("baseline_context", &ctx.baseline_context);
            text("project_context", &ctx.project_context);
            text("task_context", &ctx.task_context);
            text("additional_context", &ctx.additional_context);
            let mut list = |k: &str, v: &[String]| {
                if !v.is_empty() {
                    m.insert(k.into(), json!(v));
                }
            };
            list("requirements", &ctx.requirements);
            list("acceptance_criteria", &ctx.acceptance_criteria);
            list("skill_ids", &ctx.skill_ids);
            if !ctx.preferences.is_empty() {
                let prefs: Map<String, Value> = ctx
                    .preferences
                    .iter()
                    .map(|(k, v)| {
                        let s = match v {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        };
                        (k.clone(), Value::String(s))
                    })
                    .collect();
                m.insert("preferences".into(), Value::Object(prefs));
            }
            if let Some(skills) = ctx.skills.as_ref().filter(|v| !v.is_null()) {
                m.insert("skills".into(), skills.clone());
            }
            out.insert("context".into(), Value::Object(m));
        }
        if errs.is_empty() {
            Ok(Value::Object(out))
        } else {
            Err(ValidationErrors(errs))
        }
    }
}
