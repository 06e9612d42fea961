//! After a restart: every sandbox a previous run left is removed, and every job it
//! accepted or ran is settled, so nothing is silently lost. A job whose result.json is
//! complete and verified keeps that result; any other fails as `worker_restarted`.

use super::Node;
use crate::executor::response::{self, state_of};
use crate::executor::JobPaths;
use crate::store::StoreError;

impl Node {
    /// After a restart: remove every sandbox a previous run left, and settle every job that
    /// was accepted or running. A job whose result.json is complete keeps that result; any
    /// other is failed with reason `worker_restarted`.
    pub async fn reconcile(&self) -> Result<(), StoreError> {
        let removed = self.backend.remove_all_managed().await;
        if removed > 0 {
            tracing::warn!(removed, "removed sandboxes left by a previous run");
        }
        // The next new workspace's uid: a backend may make a warm sandbox for it now.
        match self.uids.next_free().await {
            Ok(Some(uid)) => self.backend.expect_uid(uid),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "cannot read the next free sandbox uid"),
        }
        let unfinished = self.store.unfinished().await?;
        // A client killed with the node may still have been creating its container: sweep
        // those names once more a little later.
        let names: Vec<String> = unfinished
            .iter()
            .map(|r| format!("cynode-{}", r.job_id))
            .collect();
        if !names.is_empty() {
            let backend = self.backend.clone();
            tokio::spawn(async move {
                for delay in [1, 3, 10] {
                    tokio::time::sleep(std::time::Duration::from_secs(delay)).await;
                    for n in &names {
                        backend.remove_named(n).await;
                    }
                }
            });
        }
        for rec in unfinished {
            self.backend
                .remove_named(&format!("cynode-{}", rec.job_id))
                .await;
            let paths = JobPaths::new(&self.cfg, &rec.request);
            let resp = response::after_restart(&rec.request, &paths).await;
            let state = state_of(&resp);
            tracing::warn!(job_id = %rec.job_id, task_id = %rec.task_id, state = ?state, "reconciled job after restart");
            self.store.finish(&rec.job_id, state, &resp).await?;
        }
        Ok(())
    }
}
