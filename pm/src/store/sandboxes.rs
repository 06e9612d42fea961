//! Who owns each sandbox and snapshot the PM's API created: one row per sandbox (its
//! tenant and worker) and per snapshot (its tenant, worker and sandbox). Every sandbox
//! call checks the row first, so another tenant's id is "not found", exactly like a
//! missing one; the ids themselves are random (`sb-`/the worker's `snap-` UUIDs).

use sqlx::Row;

use super::{now, Result, Store};

/// The owner of a sandbox or snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub tenant_id: String,
    pub worker_id: String,
}

impl Store {
    /// Records a new sandbox of `tenant_id` on `worker_id`.
    pub async fn put_sandbox(&self, sandbox_id: &str, owner: &Owner) -> Result<()> {
        sqlx::query(
            "INSERT INTO sandboxes (sandbox_id, tenant_id, worker_id, created_at) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(sandbox_id.to_string())
        .bind(owner.tenant_id.clone())
        .bind(owner.worker_id.clone())
        .bind(now())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The owner of a sandbox, if the PM created it.
    pub async fn sandbox_owner(&self, sandbox_id: &str) -> Result<Option<Owner>> {
        let row = sqlx::query("SELECT tenant_id, worker_id FROM sandboxes WHERE sandbox_id = $1")
            .bind(sandbox_id.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| owner(&r)).transpose()
    }

    /// Forgets a sandbox the worker refused to create.
    pub async fn forget_sandbox(&self, sandbox_id: &str) -> Result<()> {
        sqlx::query("DELETE FROM sandboxes WHERE sandbox_id = $1")
            .bind(sandbox_id.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The ids of the tenant's sandboxes, newest first, at most `limit`.
    pub async fn tenant_sandboxes(&self, tenant_id: &str, limit: i64) -> Result<Vec<String>> {
        let rows = sqlx::query(
            "SELECT sandbox_id FROM sandboxes WHERE tenant_id = $1 \
             ORDER BY created_at DESC, sandbox_id LIMIT $2",
        )
        .bind(tenant_id.to_string())
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| Ok(r.try_get(0)?)).collect()
    }

    /// Records a snapshot of `sandbox_id` (owned as the sandbox is).
    pub async fn put_snapshot(
        &self,
        snapshot_id: &str,
        sandbox_id: &str,
        owner: &Owner,
    ) -> Result<()> {
        sqlx::query(
            "INSERT INTO sandbox_snapshots (snapshot_id, tenant_id, worker_id, sandbox_id, created_at) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (snapshot_id) DO NOTHING",
        )
        .bind(snapshot_id.to_string())
        .bind(owner.tenant_id.clone())
        .bind(owner.worker_id.clone())
        .bind(sandbox_id.to_string())
        .bind(now())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The owner of a snapshot, if the PM recorded it.
    pub async fn snapshot_owner(&self, snapshot_id: &str) -> Result<Option<Owner>> {
        let row = sqlx::query(
            "SELECT tenant_id, worker_id FROM sandbox_snapshots WHERE snapshot_id = $1",
        )
        .bind(snapshot_id.to_string())
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| owner(&r)).transpose()
    }

    /// Forgets a deleted snapshot.
    pub async fn forget_snapshot(&self, snapshot_id: &str) -> Result<()> {
        sqlx::query("DELETE FROM sandbox_snapshots WHERE snapshot_id = $1")
            .bind(snapshot_id.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

fn owner(r: &sqlx::any::AnyRow) -> Result<Owner> {
    Ok(Owner {
        tenant_id: r.try_get(0)?,
        worker_id: r.try_get(1)?,
    })
}
