//! The job's `context`: what the PM tells the sandbox's agent about the work, filled on
//! every job it builds from the session's state and the skill, then bounded.
//!
//! Where each field comes from (upstream CyNodeAI's `context` names; the SBA shows them
//! in this order: baseline, project, task, requirements, acceptance criteria,
//! preferences, additional context, skills):
//! - `baseline_context`: the template's, else [`BASELINE`] (the seed wants a baseline in
//!   every prompt).
//! - `project_context`: the session's objective (the tenant's request). Only the PM sets
//!   it; a template that does is refused.
//! - `task_context`: the template's own when it sets one (the `agent-task` skill puts its
//!   `task` input there); otherwise the plan step the job serves (`t1: description`), or
//!   the objective when the job serves no step of the plan.
//! - `requirements`, `acceptance_criteria`, `persona_*`, `mcp_tools`:
//!   the template's (the `agent-task` skill's `acceptance_criteria` input). The SBA turns
//!   each requirement and criterion into a todo item, so the PM adds none of its own.
//! - `preferences`: the template's, plus `attempt` (`"2 of 3"`: which try of the task this
//!   job is), which the PM sets.
//! - `additional_context`: the template's, then the plan step when the template set the
//!   task itself, then the list of what was cut (below).
//! - `skill_ids` and `skills`: the skill the job is built from (its id, version and
//!   description). Only the PM sets them.
//!
//! Everything here comes from session state or the skill package, never from a model's
//! reply that skipped the policy: the plan step's text was written by the model through a
//! `state_patch`, but it reaches the sandbox only inside the job, which the policy gate
//! judges whole (context included) before it is dispatched.
//!
//! Bounds ([`Bounds`]): each text field at most [`MAX_TEXT_BYTES`], each list at most
//! [`MAX_ITEMS`] items of at most [`MAX_ITEM_BYTES`], `preferences` at most [`MAX_ITEMS`]
//! keys whose values' JSON text is at most [`MAX_ITEM_BYTES`], `skill_ids` at most
//! [`MAX_ITEMS`]. A text over its bound is cut on a character boundary and ends with
//! `…[cut N bytes]`; a list over its count keeps its first items; a preference value over
//! its bound becomes its cut JSON text. Every cut is also named in `additional_context`
//! (`[cut by the PM: task_context (N bytes), acceptance_criteria (M items)]`), so the
//! agent, the policy and an auditor all see that the context is not whole.

use cynode_protocol::job::JobContext;
use serde_json::{Map, Value};

/// Longest text field (`task_context`, `project_context`, …), in bytes.
pub const MAX_TEXT_BYTES: usize = 4096;
/// Longest list item or preference value (its JSON text), in bytes.
pub const MAX_ITEM_BYTES: usize = 1024;
/// Most items of a list (`requirements`, `acceptance_criteria`, `skill_ids`) and most
/// keys of `preferences`.
pub const MAX_ITEMS: usize = 16;

/// The sandbox agent's baseline (identity, role, non-goals) when the template gives none.
pub const BASELINE: &str = "You are the sandbox agent of one CyNode job: you do the task \
below in /workspace and nowhere else, within the job's limits. You do not widen your \
limits, reach the network, or take on work beyond the task; when the task cannot be done, \
you finish with failure and say why.";

/// The context fields only the PM sets.
pub const PM_FIELDS: [&str; 3] = ["project_context", "skill_ids", "skills"];

/// What the PM knows of the job's place in its session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Brief {
    /// The session's objective.
    pub objective: String,
    /// The plan step the job serves: `(task_id, description)`.
    pub step: Option<(String, String)>,
    /// Which try of the task this is (1-based) and how many are allowed; `None` outside a
    /// session.
    pub attempt: Option<(u32, u32)>,
}

/// The bounds one context is held to (the constants above, by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub text_bytes: usize,
    pub item_bytes: usize,
    pub items: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            text_bytes: MAX_TEXT_BYTES,
            item_bytes: MAX_ITEM_BYTES,
            items: MAX_ITEMS,
        }
    }
}

/// The skill a job is built from, as the context names it.
#[derive(Debug, Clone, Copy)]
pub struct SkillRef<'a> {
    pub skill_id: &'a str,
    pub version: &'a str,
    pub description: &'a str,
}

/// `s` cut to `max` bytes on a character boundary, marked `…[cut N bytes]`; `None` when
/// it fits.
pub fn cut(s: &str, max: usize) -> Option<String> {
    if s.len() <= max {
        return None;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Some(format!("{}…[cut {} bytes]", &s[..end], s.len() - end))
}

/// Fills `ctx` (the template's context, possibly empty) from `brief` and `skill`, then
/// bounds it (see the module doc).
pub fn fill(mut ctx: JobContext, brief: &Brief, skill: SkillRef<'_>) -> JobContext {
    let step = brief
        .step
        .as_ref()
        .map(|(id, d)| format!("{id}: {}", d.trim()));
    if ctx.baseline_context.trim().is_empty() {
        ctx.baseline_context = BASELINE.to_string();
    }
    ctx.project_context = brief.objective.trim().to_string();
    if ctx.task_context.trim().is_empty() {
        ctx.task_context = step.clone().unwrap_or_else(|| ctx.project_context.clone());
    } else if let Some(step) = &step {
        let plan = format!("Plan step {step}");
        ctx.additional_context = [ctx.additional_context.trim(), plan.as_str()]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join("\n");
    }
    if let Some((n, of)) = brief.attempt {
        ctx.preferences
            .insert("attempt".into(), Value::String(format!("{n} of {of}")));
    }
    ctx.skill_ids = vec![skill.skill_id.to_string()];
    let mut skills = Map::new();
    skills.insert(
        skill.skill_id.to_string(),
        serde_json::json!({ "version": skill.version, "description": skill.description }),
    );
    ctx.skills = Some(Value::Object(skills));
    bound(ctx, Bounds::default())
}

/// Holds `ctx` to `b`, marking every cut in place and naming it in `additional_context`.
pub fn bound(mut ctx: JobContext, b: Bounds) -> JobContext {
    let mut cuts: Vec<String> = Vec::new();
    let text = |name: &str, s: &mut String, cuts: &mut Vec<String>| {
        if let Some(c) = cut(s, b.text_bytes) {
            cuts.push(format!("{name} ({} bytes)", s.len() - b.text_bytes));
            *s = c;
        }
    };
    text("persona_title", &mut ctx.persona_title, &mut cuts);
    text(
        "persona_description",
        &mut ctx.persona_description,
        &mut cuts,
    );
    text("baseline_context", &mut ctx.baseline_context, &mut cuts);
    text("project_context", &mut ctx.project_context, &mut cuts);
    text("task_context", &mut ctx.task_context, &mut cuts);
    let list = |name: &str, items: &mut Vec<String>, cuts: &mut Vec<String>| {
        if items.len() > b.items {
            cuts.push(format!("{name} ({} items)", items.len() - b.items));
            items.truncate(b.items);
        }
        for (i, item) in items.iter_mut().enumerate() {
            if let Some(c) = cut(item, b.item_bytes) {
                cuts.push(format!("{name}[{i}] ({} bytes)", item.len() - b.item_bytes));
                *item = c;
            }
        }
    };
    list("requirements", &mut ctx.requirements, &mut cuts);
    list(
        "acceptance_criteria",
        &mut ctx.acceptance_criteria,
        &mut cuts,
    );
    list("skill_ids", &mut ctx.skill_ids, &mut cuts);
    if ctx.preferences.len() > b.items {
        cuts.push(format!(
            "preferences ({} keys)",
            ctx.preferences.len() - b.items
        ));
        // serde_json's map is ordered by key: the first keys stay, as with lists.
        let keep: Vec<String> = ctx.preferences.keys().take(b.items).cloned().collect();
        ctx.preferences.retain(|k, _| keep.contains(k));
    }
    for (k, v) in ctx.preferences.iter_mut() {
        let json = v.to_string();
        if let Some(c) = cut(&json, b.item_bytes) {
            cuts.push(format!(
                "preferences.{k} ({} bytes)",
                json.len() - b.item_bytes
            ));
            *v = Value::String(c);
        }
    }
    if let Some(c) = ctx
        .skills
        .as_ref()
        .map(Value::to_string)
        .and_then(|j| cut(&j, b.text_bytes).map(|c| (j.len(), c)))
    {
        cuts.push(format!("skills ({} bytes)", c.0 - b.text_bytes));
        ctx.skills = Some(Value::String(c.1));
    }
    // The notes of what was cut come last and are never cut themselves: what precedes
    // them is cut to leave them room.
    let note = (!cuts.is_empty()).then(|| format!("[cut by the PM: {}]", cuts.join(", ")));
    let room = b
        .text_bytes
        .saturating_sub(note.as_ref().map_or(0, |n| n.len() + 1));
    let mut extra = ctx.additional_context.trim().to_string();
    let extra_cut = cut(&extra, room);
    if let Some(c) = extra_cut {
        extra = c;
    }
    ctx.additional_context = [Some(extra), note]
        .into_iter()
        .flatten()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    ctx
}

/// The context as job.json carries it: empty fields left out.
pub fn to_value(ctx: &JobContext) -> Value {
    let Ok(Value::Object(map)) = serde_json::to_value(ctx) else {
        return Value::Object(Map::new());
    };
    Value::Object(
        map.into_iter()
            .filter(|(_, v)| match v {
                Value::Null => false,
                Value::String(s) => !s.is_empty(),
                Value::Array(a) => !a.is_empty(),
                Value::Object(o) => !o.is_empty(),
                _ => true,
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const SKILL: SkillRef<'static> = SkillRef {
        skill_id: "agent-task",
        version: "1.0.0",
        description: "hand a task to an agent",
    };

    fn brief() -> Brief {
        Brief {
            objective: "ship the release".into(),
            step: Some(("t2".into(), "write the notes".into())),
            attempt: Some((1, 3)),
        }
    }

    #[test]
    fn cut_marks_what_it_cut_on_a_char_boundary() {
        assert_eq!(cut("short", 5), None);
        assert_eq!(cut("héllo", 2).unwrap(), "h…[cut 5 bytes]");
        assert_eq!(cut("abcdef", 4).unwrap(), "abcd…[cut 2 bytes]");
    }

    #[test]
    fn fields_come_from_the_session_and_the_skill() {
        let c = fill(JobContext::default(), &brief(), SKILL);
        assert_eq!(c.project_context, "ship the release");
        assert_eq!(c.task_context, "t2: write the notes");
        assert_eq!(c.additional_context, "");
        assert_eq!(c.preferences["attempt"], "1 of 3");
        assert_eq!(c.skill_ids, ["agent-task"]);
        assert_eq!(
            c.skills.unwrap()["agent-task"]["version"],
            Value::from("1.0.0")
        );
        // Without a plan step the objective is the task.
        let c = fill(
            JobContext::default(),
            &Brief {
                step: None,
                ..brief()
            },
            SKILL,
        );
        assert_eq!(c.task_context, "ship the release");
    }

    #[test]
    fn a_template_task_stays_and_the_plan_step_moves_to_additional_context() {
        let ctx = JobContext {
            task_context: "make hello.txt".into(),
            acceptance_criteria: vec!["hello.txt holds hi".into()],
            project_context: "the template's own".into(),
            ..Default::default()
        };
        let c = fill(ctx, &brief(), SKILL);
        assert_eq!(c.task_context, "make hello.txt");
        assert_eq!(c.project_context, "ship the release");
        assert_eq!(c.acceptance_criteria, ["hello.txt holds hi"]);
        assert_eq!(c.additional_context, "Plan step t2: write the notes");
    }

    #[test]
    fn every_field_over_its_bound_is_cut_marked_and_named() {
        let b = Bounds {
            text_bytes: 40,
            item_bytes: 8,
            items: 2,
        };
        let mut prefs = Map::new();
        for k in ["a", "b", "c"] {
            prefs.insert(k.into(), Value::from("0123456789"));
        }
        let ctx = JobContext {
            task_context: "t".repeat(50),
            requirements: vec!["r".into(), "s".repeat(10), "u".into()],
            acceptance_criteria: vec!["ok".into()],
            preferences: prefs,
            additional_context: "x".repeat(100),
            ..Default::default()
        };
        let c = bound(ctx, b);
        assert_eq!(c.task_context, format!("{}…[cut 10 bytes]", "t".repeat(40)));
        assert_eq!(c.requirements, ["r", "ssssssss…[cut 2 bytes]"]);
        assert_eq!(c.acceptance_criteria, ["ok"]);
        assert_eq!(
            c.preferences.keys().collect::<Vec<_>>(),
            [&"a".to_string(), &"b".to_string()]
        );
        assert_eq!(c.preferences["a"], "\"0123456…[cut 4 bytes]");
        let note = "[cut by the PM: task_context (10 bytes), requirements (1 items), \
requirements[1] (2 bytes), preferences (1 keys), preferences.a (4 bytes), preferences.b (4 bytes)]";
        assert!(
            c.additional_context.ends_with(note),
            "{}",
            c.additional_context
        );
        // The note is whole even where it leaves no room for the rest.
        assert!(c.additional_context.starts_with("…[cut 100 bytes]\n["));
    }

    #[test]
    fn a_context_within_bounds_is_untouched() {
        let c = fill(JobContext::default(), &brief(), SKILL);
        assert_eq!(bound(c.clone(), Bounds::default()), c);
        assert!(!c.additional_context.contains("cut by the PM"));
    }

    #[test]
    fn empty_fields_are_left_out_of_the_job() {
        let v = to_value(&fill(JobContext::default(), &Brief::default(), SKILL));
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["baseline_context", "skill_ids", "skills"]);
    }
}
