//! The agent's own todo list: seeded from the job's requirements, acceptance criteria and
//! suggested steps, changed only through the model's `todo` action (all or nothing), and
//! written atomically to `todo.json` in the job directory after every change, so progress
//! can be read by the node while the job runs and survives a crash.

use std::path::PathBuf;

use cynode_protocol::job::{JobSpec, StepAction};
use cynode_protocol::result::{TodoItem, TodoStatus};
use serde::Serialize;

use super::contract::TodoUpdate;

/// Most items the list may hold (a runaway model cannot grow it without bound).
pub const MAX_ITEMS: usize = 64;

/// Why an update was refused; its text is fed back to the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TodoError {
    #[error("todo: cannot add an empty item (`{0}`)")]
    EmptyItem(String),
    #[error("todo: the list may hold at most {MAX_ITEMS} items")]
    TooMany,
    #[error("todo: no item with id `{0}`")]
    NoSuchItem(String),
}

/// The list and where it is persisted.
#[derive(Debug)]
pub struct Todo {
    items: Vec<TodoItem>,
    next: usize,
    path: Option<PathBuf>,
    job_id: String,
}

#[derive(Serialize)]
struct File<'a> {
    job_id: &'a str,
    updated_at: String,
    items: &'a [TodoItem],
}

impl Todo {
    /// The list a job starts with: `req-N` per requirement, `ac-N` per acceptance
    /// criterion, `step-<id>` per suggested step (an agent job's steps are suggestions).
    pub fn seed(job: &JobSpec, path: Option<PathBuf>) -> Todo {
        let mut items = Vec::new();
        let pending = |id: String, description: String| TodoItem {
            id,
            description,
            status: TodoStatus::Pending,
        };
        if let Some(c) = &job.context {
            for (i, r) in c.requirements.iter().enumerate() {
                items.push(pending(format!("req-{}", i + 1), r.clone()));
            }
            for (i, a) in c.acceptance_criteria.iter().enumerate() {
                items.push(pending(format!("ac-{}", i + 1), a.clone()));
            }
        }
        for step in &job.steps {
            items.push(pending(
                format!("step-{}", step.id),
                format!("suggested step: {}", describe(&step.action)),
            ));
        }
        items.truncate(MAX_ITEMS);
        Todo {
            items,
            next: 1,
            path,
            job_id: job.job_id.clone(),
        }
    }

    pub fn items(&self) -> &[TodoItem] {
        &self.items
    }

    /// Items not yet done.
    pub fn open(&self) -> Vec<&TodoItem> {
        self.items
            .iter()
            .filter(|i| i.status != TodoStatus::Done)
            .collect()
    }

    /// Applies an update all or nothing (ids added by `add` may be used by the other
    /// parts of the same update); the error names what is wrong.
    pub fn apply(&mut self, upd: &TodoUpdate) -> Result<(), TodoError> {
        if let Some(d) = upd.add.iter().find(|d| d.trim().is_empty()) {
            return Err(TodoError::EmptyItem(d.clone()));
        }
        if self.items.len() + upd.add.len() > MAX_ITEMS {
            return Err(TodoError::TooMany);
        }
        let mut items = self.items.clone();
        let mut next = self.next;
        for d in &upd.add {
            let id = loop {
                let id = format!("t-{next}");
                next += 1;
                if !items.iter().any(|i| i.id == id) {
                    break id;
                }
            };
            items.push(TodoItem {
                id,
                description: d.trim().to_string(),
                status: TodoStatus::Pending,
            });
        }
        for id in upd.start.iter().chain(&upd.complete).chain(&upd.reorder) {
            if !items.iter().any(|i| &i.id == id) {
                return Err(TodoError::NoSuchItem(id.clone()));
            }
        }
        for item in items.iter_mut() {
            if upd.start.contains(&item.id) && item.status == TodoStatus::Pending {
                item.status = TodoStatus::InProgress;
            }
            if upd.complete.contains(&item.id) {
                item.status = TodoStatus::Done;
            }
        }
        let mut front = Vec::new();
        for id in &upd.reorder {
            if let Some(pos) = items.iter().position(|i| &i.id == id) {
                front.push(items.remove(pos));
            }
        }
        front.append(&mut items);
        self.items = front;
        self.next = next;
        Ok(())
    }

    /// Writes todo.json atomically; a failure is logged, never fails the job.
    pub fn persist(&self) {
        let Some(path) = &self.path else { return };
        let file = File {
            job_id: &self.job_id,
            updated_at: cynode_protocol::time::now_rfc3339(),
            items: &self.items,
        };
        if let Err(e) = crate::result_file::write_json_atomic(path, &file) {
            tracing::warn!(job_id = %self.job_id, path = %path.display(), error = %e, "cannot write todo.json");
        }
    }

    /// The list as the prompt shows it.
    pub fn render(&self) -> String {
        if self.items.is_empty() {
            return "(empty: add items with the todo action)".into();
        }
        self.items
            .iter()
            .map(|i| {
                let mark = match i.status {
                    TodoStatus::Pending => "[ ]",
                    TodoStatus::InProgress => "[~]",
                    TodoStatus::Done => "[x]",
                };
                format!("{mark} {}: {}", i.id, i.description)
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// A one-line description of a suggested step.
fn describe(a: &StepAction) -> String {
    match a {
        StepAction::RunCommand(r) => {
            let mut s = format!("run_command {}", r.command);
            for arg in &r.args {
                s.push(' ');
                s.push_str(arg);
            }
            s
        }
        StepAction::WriteFile(w) => format!("write_file {}", w.path),
        StepAction::ReadFile(r) => format!("read_file {}", r.path),
        StepAction::ApplyUnifiedDiff(_) => "apply_unified_diff".into(),
        StepAction::ListTree(l) => format!("list_tree {}", l.path.as_deref().unwrap_or(".")),
        StepAction::SearchFiles(s) => format!("search_files {}", s.pattern),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> JobSpec {
        JobSpec::from_json(
            br#"{"protocol_version":"1.0","job_id":"j","task_id":"t",
                "execution_mode":"agent_inference",
                "inference":{"allowed_models":["m"]},
                "constraints":{"max_runtime_seconds":5,"max_output_bytes":10},
                "context":{"requirements":["r one"],"acceptance_criteria":["a one"]},
                "steps":[{"id":"s","type":"run_command","arguments":{"command":"go","args":["test"]}}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn seeds_and_applies_all_or_nothing() {
        let mut t = Todo::seed(&job(), None);
        let ids: Vec<_> = t.items().iter().map(|i| i.id.as_str()).collect();
        assert_eq!(ids, ["req-1", "ac-1", "step-s"]);
        assert_eq!(
            t.items()[2].description,
            "suggested step: run_command go test"
        );
        let bad = TodoUpdate {
            add: vec!["new".into()],
            complete: vec!["nope".into()],
            ..Default::default()
        };
        assert_eq!(
            t.apply(&bad).map_err(|e| e.to_string()),
            Err("todo: no item with id `nope`".into())
        );
        assert_eq!(t.items().len(), 3);
        t.apply(&TodoUpdate {
            add: vec!["new".into()],
            start: vec!["ac-1".into()],
            complete: vec!["req-1".into()],
            reorder: vec!["t-1".into(), "step-s".into()],
        })
        .unwrap();
        let got: Vec<_> = t
            .items()
            .iter()
            .map(|i| (i.id.as_str(), i.status))
            .collect();
        assert_eq!(
            got,
            [
                ("t-1", TodoStatus::Pending),
                ("step-s", TodoStatus::Pending),
                ("req-1", TodoStatus::Done),
                ("ac-1", TodoStatus::InProgress),
            ]
        );
        assert_eq!(t.open().len(), 3);
    }
}
