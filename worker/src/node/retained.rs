//! Finished jobs kept for their caller until acked: their artifacts (opened beneath the
//! job directory, no links, regular files only) and the expiry of jobs nobody acked
//! within `retention_seconds`.

use cynode_protocol::time::format_rfc3339;
use cynode_protocol::ValidationError;

use super::{Node, NodeError};
use crate::executor::{self, JobPaths};
use crate::sandbox_files::{self, ReadError};

impl Node {
    /// An artifact of a finished job, opened beneath the job's artifacts directory without
    /// following links (a regular file only); with its size.
    pub async fn artifact(
        &self,
        job_id: &str,
        rel: &str,
    ) -> Result<(std::fs::File, u64), NodeError> {
        let rec = self.finished_record(job_id).await?;
        if rel.is_empty()
            || !std::path::Path::new(rel)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)))
        {
            return Err(NodeError::Invalid(ValidationError::new(
                "path",
                "artifact paths are relative and contain no `..`",
            )));
        }
        // Beneath the job directory: a job that swapped `artifacts` itself for a link is
        // refused like a link inside it.
        let base = JobPaths::new(&self.cfg, &rec.request).mount;
        let rel_owned = format!("{}/{rel}", executor::ARTIFACTS_DIR);
        let opened = tokio::task::spawn_blocking(move || {
            let dir = sandbox_files::open_dir(&base).map_err(|e| ReadError::Io {
                path: "job directory".into(),
                source: e,
            })?;
            sandbox_files::open_regular(std::os::fd::AsFd::as_fd(&dir), &rel_owned, u64::MAX)
        })
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))?;
        opened.map_err(|e| {
            tracing::info!(job_id = %job_id, error = %e, "artifact refused");
            NodeError::NotFound(format!("artifact {rel}"))
        })
    }

    /// Deletes finished jobs nobody acked within `retention_seconds`.
    pub async fn expire_retained(&self) {
        let cutoff = time::OffsetDateTime::now_utc()
            - time::Duration::seconds(
                i64::try_from(self.cfg.retention_seconds).unwrap_or(i64::MAX),
            );
        let cutoff = format_rfc3339(cutoff);
        match self.store.expired(&cutoff).await {
            Ok(ids) => {
                for id in ids {
                    match self.ack(&id).await {
                        Ok(()) => tracing::info!(job_id = %id, "retention expired; job deleted"),
                        Err(e) => tracing::warn!(job_id = %id, error = %e, "cannot expire job"),
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "retention sweep failed"),
        }
    }
}
