//! The evidence report: what a session's deliverable says, composed by the PM from what
//! it verified itself (each job's worker result and the sha256-checked artifacts), never
//! from the model's words. The model's own summary is one bounded field at its end.
//!
//! A job's evidence is recorded when its result is taken in (`driver::feedback`), so the
//! report of a failed or running session shows what was found so far too.

use cynode_protocol::result::{ArtifactRecord, StepOutput, StepRecord, TreeNode};
use cynode_protocol::session::{PlanEntry, TaskStatus};
use cynode_protocol::worker_api::RunJobResponse;
use serde::{Deserialize, Serialize};

/// Lines of a step's output the report keeps.
pub const OUTPUT_HEAD_LINES: usize = 5;
/// Characters of one kept output line.
pub const OUTPUT_LINE_CHARS: usize = 200;
/// Matches of a search step the report lists (all are counted).
pub const MATCHES_LISTED: usize = 10;
/// Characters of the model's summary the report keeps.
pub const SUMMARY_CHARS: usize = 600;

/// A session's report: per task, its jobs and what each verifiably found; then the
/// model's summary, bounded.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EvidenceReport {
    /// The plan's tasks in plan order, then tasks jobs ran for outside the plan.
    pub tasks: Vec<TaskEvidence>,
    /// The model's summary, at most [`SUMMARY_CHARS`] characters; null before a `final`.
    pub summary: Option<String>,
    /// The model's summary was longer and was cut.
    #[serde(default)]
    pub summary_truncated: bool,
}

/// One task and the jobs run for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TaskEvidence {
    pub task_id: String,
    /// The plan's description of the task (empty for a task not in the plan).
    pub description: String,
    /// pending, in_progress, done, failed or skipped; null for a task not in the plan.
    #[schema(value_type = Option<String>)]
    pub status: Option<TaskStatus>,
    /// Why the model closed the task without running it (status `skipped`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub jobs: Vec<JobEvidence>,
}

/// One job's verified outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobEvidence {
    pub job_id: String,
    pub task_id: String,
    pub skill_id: String,
    /// 1 for the task's first job.
    pub attempt: u32,
    /// The worker's status: completed, failed or timeout.
    pub status: String,
    /// Why it failed (the runner's failure code and message, or the worker's reason).
    pub failure: Option<String>,
    pub steps: Vec<StepEvidence>,
    /// The artifacts fetched and verified against their sha256.
    #[schema(value_type = Vec<Object>)]
    pub artifacts: Vec<ArtifactRecord>,
}

/// One step's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StepEvidence {
    pub id: String,
    /// The step type (`run_command`, `list_tree`, `search_files`…).
    #[serde(rename = "type")]
    pub step_type: String,
    /// success, failure, timeout or skipped.
    pub status: String,
    /// A command's exit code (null when not a command or killed by a signal).
    pub exit_code: Option<i32>,
    /// The first [`OUTPUT_HEAD_LINES`] non-empty lines of its output, each cut at
    /// [`OUTPUT_LINE_CHARS`] characters.
    pub output_head: Vec<String>,
    /// Lines of output not shown.
    pub output_lines_more: usize,
    /// A list_tree's entries (files and directories, the root not counted).
    pub tree_entries: Option<u64>,
    /// A search_files' match count.
    pub matches: Option<u64>,
    /// The first [`MATCHES_LISTED`] matches as `path:line`.
    pub match_locations: Vec<String>,
    /// The step's error, when it failed.
    pub error: Option<String>,
}

/// The evidence of a job's result: its steps' outcomes and its verified artifacts.
/// `attempt` counts from 0 (as `Dispatch::attempt`); the evidence counts from 1.
pub fn job_evidence(
    job_id: &str,
    task_id: &str,
    skill_id: &str,
    attempt: u32,
    resp: &RunJobResponse,
    failure: Option<String>,
    verified: Vec<ArtifactRecord>,
) -> JobEvidence {
    let steps = resp
        .sba_result
        .as_ref()
        .map(|r| r.steps.iter().map(step_evidence).collect())
        .unwrap_or_default();
    JobEvidence {
        job_id: job_id.to_string(),
        task_id: task_id.to_string(),
        skill_id: skill_id.to_string(),
        attempt: attempt + 1,
        status: format!("{:?}", resp.status).to_lowercase(),
        failure,
        steps,
        artifacts: verified,
    }
}

fn step_evidence(s: &StepRecord) -> StepEvidence {
    let output = match (&s.result, s.output.is_empty()) {
        (_, false) => s.output.clone(),
        (Some(StepOutput::RunCommand(r)), true) => format!("{}{}", r.stdout, r.stderr),
        (Some(StepOutput::ReadFile(r)), true) => r.content.clone(),
        _ => String::new(),
    };
    let lines: Vec<&str> = output.lines().filter(|l| !l.trim().is_empty()).collect();
    let output_head: Vec<String> = lines
        .iter()
        .take(OUTPUT_HEAD_LINES)
        .map(|l| clip(l, OUTPUT_LINE_CHARS).0)
        .collect();
    let (mut tree_entries, mut matches, mut match_locations) = (None, None, Vec::new());
    let exit_code = match &s.result {
        Some(StepOutput::RunCommand(r)) => r.exit_code.or(s.exit_code),
        _ => s.exit_code,
    };
    match &s.result {
        Some(StepOutput::ListTree(t)) => tree_entries = Some(count_entries(&t.tree)),
        Some(StepOutput::SearchFiles(m)) => {
            matches = Some(m.matches.len() as u64);
            match_locations = m
                .matches
                .iter()
                .take(MATCHES_LISTED)
                .map(|m| format!("{}:{}", m.path, m.line))
                .collect();
        }
        // An upstream result has no typed output: count its output's lines.
        None if s.step_type.as_str() == "list_tree" => tree_entries = Some(lines.len() as u64),
        None if s.step_type.as_str() == "search_files" => {
            matches = Some(lines.len() as u64);
            // Its lines are `path:line:text`.
            match_locations = lines
                .iter()
                .take(MATCHES_LISTED)
                .filter_map(|l| {
                    let mut parts = l.splitn(3, ':');
                    Some(format!("{}:{}", parts.next()?, parts.next()?))
                })
                .collect();
        }
        _ => {}
    }
    StepEvidence {
        id: s.id.clone(),
        step_type: s.step_type.as_str().to_string(),
        status: serde_json::to_value(s.status)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        exit_code,
        output_lines_more: lines.len().saturating_sub(output_head.len()),
        output_head,
        tree_entries,
        matches,
        match_locations,
        error: s.error.as_ref().map(|e| clip(e, OUTPUT_LINE_CHARS).0),
    }
}

fn count_entries(t: &TreeNode) -> u64 {
    let mut n = 0;
    let mut stack: Vec<&TreeNode> = t.children.iter().collect();
    while let Some(node) = stack.pop() {
        n += 1;
        stack.extend(node.children.iter());
    }
    n
}

/// `text` on one line, cut at `max` characters (with `…`); true when it was cut.
pub fn clip(text: &str, max: usize) -> (String, bool) {
    let one = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match one.char_indices().nth(max) {
        Some((i, _)) => (format!("{}…", &one[..i]), true),
        None => (one, false),
    }
}

/// The report of a session from its plan, its recorded job evidence and the model's
/// summary (when it gave one).
pub fn compose(plan: &[PlanEntry], jobs: &[JobEvidence], summary: Option<&str>) -> EvidenceReport {
    let mut tasks: Vec<TaskEvidence> = plan
        .iter()
        .map(|p| TaskEvidence {
            task_id: p.task_id.clone(),
            description: p.description.clone(),
            status: Some(p.status),
            reason: p.reason.clone(),
            jobs: Vec::new(),
        })
        .collect();
    for j in jobs {
        match tasks.iter_mut().find(|t| t.task_id == j.task_id) {
            Some(t) => t.jobs.push(j.clone()),
            None => tasks.push(TaskEvidence {
                task_id: j.task_id.clone(),
                description: String::new(),
                status: None,
                reason: None,
                jobs: vec![j.clone()],
            }),
        }
    }
    let (summary, summary_truncated) = match summary.map(|s| clip(s, SUMMARY_CHARS)) {
        Some((s, cut)) => (Some(s), cut),
        None => (None, false),
    };
    EvidenceReport {
        tasks,
        summary,
        summary_truncated,
    }
}

impl EvidenceReport {
    /// The report for a person: a block per task, a line per job and step, the verified
    /// artifacts, then the model's summary.
    pub fn to_text(&self) -> String {
        format!("{}{}\n", self.evidence_text(), self.summary_line())
    }

    /// The model's summary on one line, labelled as the model's.
    pub fn summary_line(&self) -> String {
        match &self.summary {
            Some(s) => format!(
                "model's summary{}: {s}",
                if self.summary_truncated { " (cut)" } else { "" }
            ),
            None => "model's summary: none yet".to_string(),
        }
    }

    /// [`EvidenceReport::to_text`] without the summary.
    pub fn evidence_text(&self) -> String {
        let mut out = String::new();
        let mut line = |s: String| {
            out.push_str(&s);
            out.push('\n');
        };
        if self.tasks.is_empty() {
            line("no tasks and no jobs".to_string());
        }
        for t in &self.tasks {
            let status = t
                .status
                .and_then(|s| serde_json::to_value(s).ok())
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_else(|| "not in the plan".to_string());
            let desc = if t.description.is_empty() {
                String::new()
            } else {
                format!(": {}", clip(&t.description, 120).0)
            };
            line(format!("task {} [{status}]{desc}", t.task_id));
            if let Some(r) = &t.reason {
                line(format!("  skipped by the model: {}", clip(r, 160).0));
            }
            if t.jobs.is_empty() {
                line("  no job ran".to_string());
            }
            for j in &t.jobs {
                let why = j
                    .failure
                    .as_ref()
                    .map(|f| format!(" ({})", clip(f, 160).0))
                    .unwrap_or_default();
                line(format!(
                    "  job {} skill {} attempt {}: {}{why}",
                    j.job_id, j.skill_id, j.attempt, j.status
                ));
                for s in &j.steps {
                    let mut facts = vec![s.status.clone()];
                    if let Some(c) = s.exit_code {
                        facts.push(format!("exit {c}"));
                    }
                    if let Some(n) = s.tree_entries {
                        facts.push(format!("{n} entries"));
                    }
                    if let Some(n) = s.matches {
                        facts.push(format!("{n} matches"));
                    }
                    line(format!(
                        "    step {} {}: {}",
                        s.id,
                        s.step_type,
                        facts.join(", ")
                    ));
                    if !s.match_locations.is_empty() {
                        line(format!("      at {}", s.match_locations.join(" ")));
                    }
                    for l in &s.output_head {
                        line(format!("      | {l}"));
                    }
                    if s.output_lines_more > 0 {
                        line(format!("      | … {} more lines", s.output_lines_more));
                    }
                    if let Some(e) = &s.error {
                        line(format!("      error: {e}"));
                    }
                }
                for a in &j.artifacts {
                    line(format!(
                        "    artifact {} sha256:{} ({} bytes, verified)",
                        a.path, a.sha256, a.size_bytes
                    ));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cynode_protocol::result::*;
    use cynode_protocol::worker_api::WorkerJobStatus;

    fn step(id: &str, ty: &str, output: &str, result: Option<StepOutput>) -> StepRecord {
        serde_json::from_value(serde_json::json!({
            "id": id, "type": ty, "status": "success", "output": output,
            "result": result,
        }))
        .unwrap()
    }

    fn response(steps: Vec<StepRecord>) -> RunJobResponse {
        let mut r: RunJobResponse = serde_json::from_value(serde_json::json!({
            "version": 1, "task_id": "t1", "job_id": "j1", "status": "completed",
        }))
        .unwrap();
        r.status = WorkerJobStatus::Completed;
        r.sba_result = Some(
            serde_json::from_value(serde_json::json!({
                "protocol_version": "1", "job_id": "j1", "task_id": "t1",
                "status": "success", "started_at": "", "finished_at": "",
                "steps": steps, "artifacts": [],
                "resource_usage": {"cpu_time_ms": 0, "max_rss_bytes": 0},
            }))
            .unwrap(),
        );
        r
    }

    #[test]
    fn each_step_says_what_it_found() {
        let tree = TreeNode {
            name: ".".into(),
            entry_type: EntryType::Dir,
            size_bytes: None,
            children: vec![
                TreeNode {
                    name: "src".into(),
                    entry_type: EntryType::Dir,
                    size_bytes: None,
                    children: vec![TreeNode {
                        name: "main.rs".into(),
                        entry_type: EntryType::File,
                        size_bytes: Some(3),
                        children: vec![],
                    }],
                },
                TreeNode {
                    name: "README".into(),
                    entry_type: EntryType::File,
                    size_bytes: Some(1),
                    children: vec![],
                },
            ],
        };
        let many: String = (1..=9).map(|i| format!("line {i}\n")).collect();
        let resp = response(vec![
            step(
                "cmd",
                "run_command",
                &many,
                Some(StepOutput::RunCommand(RunCommandOutput {
                    exit_code: Some(2),
                    signal: None,
                    stdout: many.clone(),
                    stderr: String::new(),
                    duration_ms: 1,
                    truncated: false,
                })),
            ),
            step(
                "tree",
                "list_tree",
                "src/\nsrc/main.rs\nREADME\n",
                Some(StepOutput::ListTree(ListTreeOutput {
                    tree,
                    truncated: false,
                })),
            ),
            step(
                "grep",
                "search_files",
                "a.rs:3:x\nb.rs:9:x\n",
                Some(StepOutput::SearchFiles(SearchFilesOutput {
                    matches: vec![
                        SearchMatch {
                            path: "a.rs".into(),
                            line: 3,
                            text: "x".into(),
                        },
                        SearchMatch {
                            path: "b.rs".into(),
                            line: 9,
                            text: "x".into(),
                        },
                    ],
                    truncated: false,
                })),
            ),
        ]);
        let j = job_evidence("j1", "t1", "repo-inspect", 0, &resp, None, vec![]);
        assert_eq!(j.attempt, 1);
        assert_eq!(j.steps[0].exit_code, Some(2));
        assert_eq!(j.steps[0].output_head.len(), OUTPUT_HEAD_LINES);
        assert_eq!(j.steps[0].output_head[0], "line 1");
        assert_eq!(j.steps[0].output_lines_more, 4);
        assert_eq!(j.steps[1].tree_entries, Some(3));
        assert_eq!(j.steps[2].matches, Some(2));
        assert_eq!(j.steps[2].match_locations, ["a.rs:3", "b.rs:9"]);
        let report = compose(&[], &[j], Some("found it"));
        let text = report.to_text();
        assert!(text.contains("task t1 [not in the plan]"), "{text}");
        assert!(
            text.contains("step tree list_tree: success, 3 entries"),
            "{text}"
        );
        assert!(text.contains("2 matches"), "{text}");
        assert!(text.contains("exit 2"), "{text}");
        assert!(text.ends_with("model's summary: found it\n"), "{text}");
    }

    #[test]
    fn the_summary_is_one_bounded_field() {
        let long = "the plan_update is finished, ".repeat(100);
        let r = compose(&[], &[], Some(&long));
        let s = r.summary.unwrap();
        assert!(r.summary_truncated);
        assert_eq!(s.chars().count(), SUMMARY_CHARS + 1);
        assert!(!s.contains('\n'));
        let r = compose(&[], &[], Some("short\nsummary"));
        assert_eq!(r.summary.as_deref(), Some("short summary"));
        assert!(!r.summary_truncated);
    }
}
