//! What the model reads: the system prompt (the action contract and the rules), the job
//! message (the persona first when there is one, then the context sections in the seed's order,
//! each headed, then the limits and the todo list), and one observation per action, each cut
//! to a fixed size.

use cynode_protocol::job::{JobSpec, STEP_DEFS};
use cynode_protocol::result::{StepOutput, StepRecord, StepStatus};

use super::text::cut;

/// Cap on one context section, in bytes.
pub const MAX_SECTION_BYTES: usize = 8 * 1024;
/// Cap on one observation fed back to the model, in bytes.
pub const MAX_OBSERVATION_BYTES: usize = 4 * 1024;

/// The system prompt; the `tool_call` action is described only when the job lists
/// gateway tools (`tools`, from `context.mcp_tools`).
pub fn system(workspace: &str, tools: &[String]) -> String {
    let step_lines: String = STEP_DEFS
        .iter()
        .map(|d| format!("- {}\n", d.prompt_line()))
        .collect();
    let tool_lines = if tools.is_empty() {
        String::new()
    } else {
        let mut t = "- tool_call {\"name\": \"<tool>\", \"arguments\": {...}}: call a tool of the \
task's gateway; only these tools:\n"
            .to_string();
        for name in tools {
            t.push_str(&format!("  - {name} {}\n", super::tools::hint(name)));
        }
        t
    };
    format!(
        "You are cynode-sba, an agent working inside a sandbox on one job. You act only through \
the actions below; each reply is exactly one JSON object:\n\
{{\"thought\": \"<one short sentence>\", \"action\": {{\"type\": \"<action>\", \"arguments\": {{...}}}}}}\n\n\
Actions:\n\
{step_lines}\
{tool_lines}\
- todo {{\"add\": [\"<new item>\"], \"start\": [\"<id>\"], \"complete\": [\"<id>\"], \"reorder\": [\"<id>\"]}}: update your todo list.\n\
- finish {{\"status\": \"success\", \"final_answer\": \"<what was done>\"}}: end the job; status \"failure\" if the goal cannot be met.\n\n\
Rules: paths are relative to the workspace {workspace} and may not leave it. Work through \
the todo list, mark items complete when done, and finish with success only when every item \
is done. After each action you get its result."
    )
}

fn list(items: &[String]) -> String {
    if items.is_empty() {
        return "(none)".into();
    }
    items
        .iter()
        .map(|i| format!("- {i}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The heading of the job's persona, the first section when the job has one.
pub const PERSONA: &str = "Persona";

/// The sections of the job message, in the seed's order; each is a `## ` heading.
pub const SECTIONS: [&str; 10] = [
    "Baseline context",
    "Project context",
    "Task",
    "Requirements",
    "Acceptance criteria",
    "Preferences",
    "Additional context",
    "Skills",
    "Limits",
    "Todo list",
];

/// The job message: the persona first when there is one, then the seed's context order,
/// every section headed (baseline and task always present), then the limits and the todo
/// list.
pub fn job_message(job: &JobSpec, remaining_secs: u64, max_turns: u32, todo: &str) -> String {
    let c = job.context.clone().unwrap_or_default();
    let text = |s: &str| {
        if s.trim().is_empty() {
            "(none)".to_string()
        } else {
            cut(s.trim(), MAX_SECTION_BYTES)
        }
    };
    let json = |v: Option<serde_json::Value>| match v {
        Some(v) if !v.is_null() && v != serde_json::json!({}) => cut(
            &serde_json::to_string_pretty(&v).unwrap_or_default(),
            MAX_SECTION_BYTES,
        ),
        _ => "(none)".into(),
    };
    let mut skills = json(c.skills.clone());
    if !c.skill_ids.is_empty() {
        skills = format!("ids: {}\n{skills}", c.skill_ids.join(", "));
    }
    let k = &job.constraints;
    let mut limits = format!(
        "- remaining time: {remaining_secs} s (the whole job, model calls included)\n\
- output per action: at most {} bytes of stdout+stderr; more fails the job\n\
- turns: at most {max_turns} replies\n\
- network: none",
        k.max_output_bytes
    );
    if let Some(cmds) = &k.allowed_commands {
        limits.push_str(&format!("\n- allowed commands: {}", cmds.join(", ")));
    }
    if let Some(paths) = &k.allowed_paths {
        limits.push_str(&format!("\n- allowed paths: {}", paths.join(", ")));
    }
    let bodies = [
        text(&c.baseline_context),
        text(&c.project_context),
        text(&c.task_context),
        list(&c.requirements),
        list(&c.acceptance_criteria),
        json(Some(serde_json::Value::Object(c.preferences.clone()))),
        text(&c.additional_context),
        skills,
        limits,
        todo.to_string(),
    ];
    // The persona, when the job has one, is the first block (upstream REQ-SBAGNT-0113).
    let persona = [c.persona_title.trim(), c.persona_description.trim()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    let persona = (!persona.is_empty())
        .then(|| format!("## {PERSONA}\n{}", cut(&persona, MAX_SECTION_BYTES)));
    persona
        .into_iter()
        .chain(
            SECTIONS
                .iter()
                .zip(bodies)
                .map(|(h, body)| format!("## {h}\n{body}")),
        )
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// What the model learns from a step: status, error, and the output (cut to size).
pub fn observation(rec: &StepRecord, remaining_secs: u64, turns_left: u32) -> String {
    let status = match rec.status {
        StepStatus::Success => "success",
        StepStatus::Failure => "failure",
        StepStatus::Timeout => "timeout",
        StepStatus::Skipped => "skipped",
    };
    let mut s = format!(
        "Result of {} ({}): {status}",
        rec.id,
        rec.step_type.as_str()
    );
    if let Some(e) = rec.error_info() {
        s.push_str(&format!("\nerror ({}): {}", e.kind.as_str(), e.message));
    }
    let out = match &rec.result {
        Some(StepOutput::RunCommand(r)) => format!(
            "exit_code: {}\nstdout:\n{}\nstderr:\n{}",
            r.exit_code.map_or("none".into(), |c| c.to_string()),
            r.stdout,
            r.stderr
        ),
        Some(StepOutput::ReadFile(r)) => format!(
            "size_bytes: {}, truncated: {}\ncontent:\n{}",
            r.size_bytes, r.truncated, r.content
        ),
        Some(other) => serde_json::to_string(other).unwrap_or_default(),
        None => String::new(),
    };
    if !out.is_empty() {
        s.push('\n');
        s.push_str(&cut(&out, MAX_OBSERVATION_BYTES));
    }
    s.push_str(&footer(remaining_secs, turns_left));
    s
}

/// What the model learns from a tool call: the outcome and the result or the reason
/// (already cut to size by the caller).
pub fn tool_observation(
    tool: &str,
    outcome: cynode_protocol::result::ToolCallOutcome,
    text: &str,
    remaining_secs: u64,
    turns_left: u32,
) -> String {
    use cynode_protocol::result::ToolCallOutcome as O;
    let outcome = match outcome {
        O::Ok => "ok",
        O::Refused => "refused",
        O::Error => "error",
    };
    format!(
        "Result of tool_call {tool}: {outcome}\n{text}{}",
        footer(remaining_secs, turns_left)
    )
}

/// The line closing every message after the first: time and turns left.
pub fn footer(remaining_secs: u64, turns_left: u32) -> String {
    format!("\n\n[remaining time: {remaining_secs} s, turns left: {turns_left}]")
}

#[cfg(test)]
mod tests {
    /// The step lines generated from the protocol's definitions are the ones models read.
    #[test]
    fn the_step_lines_are_generated_unchanged() {
        let want = "Actions:\n\
- write_file {\"path\": \"<file>\", \"content\": \"<text>\"}: create a file.\n\
- read_file {\"path\": \"<file>\"}: read a file.\n\
- run_command {\"command\": \"<program>\", \"args\": [\"<arg>\"]}: run a program directly (no shell).\n\
- list_tree {\"path\": \"<dir>\"}: list files.\n\
- search_files {\"pattern\": \"<regex>\", \"path\": \"<dir>\"}: search text in files.\n\
- apply_unified_diff {\"diff\": \"<unified diff>\"}: change files.\n\
- todo";
        assert!(super::system("/workspace", &[]).contains(want));
    }

    use super::*;

    #[test]
    fn sections_come_in_seed_order_with_headings() {
        let job = JobSpec::from_json(
            br#"{"protocol_version":"1.0","job_id":"j","task_id":"t",
                "inference":{"allowed_models":["m"]},
                "constraints":{"max_runtime_seconds":60,"max_output_bytes":100},
                "context":{"task_context":"make hello.txt","requirements":["r"],
                           "preferences":{"style":"terse"}}}"#,
        )
        .unwrap();
        let m = job_message(&job, 59, 10, "[ ] req-1: r");
        let heads: Vec<&str> = m.lines().filter(|l| l.starts_with("## ")).collect();
        assert_eq!(
            heads,
            [
                "## Baseline context",
                "## Project context",
                "## Task",
                "## Requirements",
                "## Acceptance criteria",
                "## Preferences",
                "## Additional context",
                "## Skills",
                "## Limits",
                "## Todo list"
            ]
        );
        assert!(m.contains("## Task\nmake hello.txt"), "{m}");
        assert!(!m.contains("## Persona"), "{m}");
        assert!(m.contains("## Baseline context\n(none)"), "{m}");
        assert!(m.contains("remaining time: 59 s"), "{m}");
        assert!(m.contains("at most 100 bytes"), "{m}");
        assert!(m.contains("\"style\": \"terse\""), "{m}");
    }

    #[test]
    fn the_persona_comes_first_when_the_job_has_one() {
        let job = JobSpec::from_json(
            br#"{"protocol_version":"1.0","job_id":"j","task_id":"t",
                "inference":{"allowed_models":["m"]},
                "constraints":{"max_runtime_seconds":60,"max_output_bytes":100},
                "context":{"persona_title":"Release engineer",
                           "persona_description":"Careful with tags.",
                           "baseline_context":"b","task_context":"x"}}"#,
        )
        .unwrap();
        let m = job_message(&job, 59, 10, "");
        assert!(
            m.starts_with(
                "## Persona\nRelease engineer\nCareful with tags.\n\n## Baseline context\nb"
            ),
            "{m}"
        );
        let heads = m.lines().filter(|l| l.starts_with("## ")).count();
        assert_eq!(heads, SECTIONS.len() + 1);
    }
}
