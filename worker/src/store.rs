//! Node-local durable job records in SQLite (sqlx, migrations under
//! `migrations/worker/`), with the suspended sessions and workspace snapshots that outlive
//! a node restart. A record is written before a job starts and updated before any
//! answer is given, so a node killed at any point knows every job it accepted.

use std::path::Path;
use std::str::FromStr;

use cynode_protocol::worker_api::{AsyncJobState, RunJobRequest, RunJobResponse};
use cynode_protocol::worker_session_state::SnapshotInfo;
use cynode_protocol::worker_sessions::{CreateSessionRequest, SessionInfo};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Row, SqlitePool};

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("stored json: {0}")]
    Json(#[from] serde_json::Error),
    #[error("unknown stored state `{0}`")]
    State(String),
}

/// Crate-local result alias.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Sync (`jobs:run`) or async (`jobs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Sync,
    Async,
}

/// One stored job.
#[derive(Debug, Clone)]
pub struct JobRecord {
    pub job_id: String,
    pub task_id: String,
    pub mode: Mode,
    pub state: AsyncJobState,
    pub request: RunJobRequest,
    /// [`request_digest`] of the request the job was accepted with.
    pub request_digest: String,
    pub response: Option<RunJobResponse>,
}

/// sha256 (hex) of the canonical JSON of `req`: object keys sorted at every level, no
/// whitespace. Two requests with the same digest are the same request.
pub fn request_digest(req: &RunJobRequest) -> Result<String> {
    use sha2::Digest;
    let v = serde_json::to_value(req)?;
    let mut out = String::new();
    canonical(&v, &mut out)?;
    Ok(hex::encode(sha2::Sha256::digest(out.as_bytes())))
}

fn canonical(v: &serde_json::Value, out: &mut String) -> Result<()> {
    match v {
        serde_json::Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(k)?);
                out.push(':');
                if let Some(x) = m.get(k) {
                    canonical(x, out)?;
                }
            }
            out.push('}');
        }
        serde_json::Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(x, out)?;
            }
            out.push(']');
        }
        other => out.push_str(&serde_json::to_string(other)?),
    }
    Ok(())
}

/// The job database.
#[derive(Debug, Clone)]
pub struct Store {
    pool: SqlitePool,
}

/// Every column [`decode`] reads, in its order.
const SELECT_JOBS: &str =
    "SELECT job_id, task_id, mode, state, request_json, response_json, request_digest FROM jobs";

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/worker");

fn state_str(s: AsyncJobState) -> &'static str {
    match s {
        AsyncJobState::Accepted => "accepted",
        AsyncJobState::InProgress => "in_progress",
        AsyncJobState::Completed => "completed",
        AsyncJobState::Failed => "failed",
        AsyncJobState::Timeout => "timeout",
        AsyncJobState::Canceled => "canceled",
    }
}

fn parse_state(s: &str) -> Result<AsyncJobState> {
    Ok(match s {
        "accepted" => AsyncJobState::Accepted,
        "in_progress" => AsyncJobState::InProgress,
        "completed" => AsyncJobState::Completed,
        "failed" => AsyncJobState::Failed,
        "timeout" => AsyncJobState::Timeout,
        "canceled" => AsyncJobState::Canceled,
        other => return Err(StoreError::State(other.to_string())),
    })
}

fn now() -> String {
    cynode_protocol::time::now_rfc3339()
}

impl Store {
    /// Opens (creating) the database at `path` and migrates it.
    pub async fn open(path: &Path) -> Result<Store> {
        let opts = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(std::time::Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(opts)
            .await?;
        MIGRATOR.run(&pool).await?;
        Ok(Store { pool })
    }

    /// Inserts a new job; returns false (and changes nothing) when the id exists.
    pub async fn insert(&self, req: &RunJobRequest, mode: Mode) -> Result<bool> {
        let mode = match mode {
            Mode::Sync => "sync",
            Mode::Async => "async",
        };
        let at = now();
        let res = sqlx::query(
            "INSERT INTO jobs (job_id, task_id, mode, state, request_json, created_at, updated_at, request_digest) \
             VALUES (?1, ?2, ?3, 'accepted', ?4, ?5, ?5, ?6) ON CONFLICT (job_id) DO NOTHING",
        )
        .bind(&req.job_id)
        .bind(&req.task_id)
        .bind(mode)
        .bind(serde_json::to_string(req)?)
        .bind(at)
        .bind(request_digest(req)?)
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    /// Moves a non-terminal job to `state`.
    pub async fn set_state(&self, job_id: &str, state: AsyncJobState) -> Result<()> {
        sqlx::query(
            "UPDATE jobs SET state = ?2, updated_at = ?3 WHERE job_id = ?1 \
             AND state IN ('accepted', 'in_progress')",
        )
        .bind(job_id)
        .bind(state_str(state))
        .bind(now())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records the terminal state and response.
    pub async fn finish(
        &self,
        job_id: &str,
        state: AsyncJobState,
        resp: &RunJobResponse,
    ) -> Result<()> {
        sqlx::query(
            "UPDATE jobs SET state = ?2, response_json = ?3, updated_at = ?4 WHERE job_id = ?1",
        )
        .bind(job_id)
        .bind(state_str(state))
        .bind(serde_json::to_string(resp)?)
        .bind(now())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// One job, if known.
    pub async fn get(&self, job_id: &str) -> Result<Option<JobRecord>> {
        let row = sqlx::query(&format!("{SELECT_JOBS} WHERE job_id = ?1"))
            .bind(job_id)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| decode(&r)).transpose()
    }

    /// Jobs that were accepted or running: after a restart they need reconciling.
    pub async fn unfinished(&self) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(&format!(
            "{SELECT_JOBS} WHERE state IN ('accepted', 'in_progress') ORDER BY created_at"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(decode).collect()
    }

    /// Terminal jobs last updated before `cutoff` (RFC 3339), for retention.
    pub async fn expired(&self, cutoff: &str) -> Result<Vec<String>> {
        let rows = sqlx::query(
            "SELECT job_id FROM jobs WHERE state NOT IN ('accepted', 'in_progress') AND updated_at < ?1",
        )
        .bind(cutoff)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(|r| r.get::<String, _>(0)).collect())
    }

    /// Forgets a job (after ack or retention).
    pub async fn delete(&self, job_id: &str) -> Result<bool> {
        let res = sqlx::query("DELETE FROM jobs WHERE job_id = ?1")
            .bind(job_id)
            .execute(&self.pool)
            .await?;
        Ok(res.rows_affected() == 1)
    }

    /// The host uid assigned to `workspace_id` ([`crate::uid_pool`]), if any.
    pub async fn workspace_uid(&self, workspace_id: &str) -> Result<Option<u32>> {
        let row = sqlx::query("SELECT uid FROM sandbox_uids WHERE workspace_id = ?1")
            .bind(workspace_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.and_then(|r| u32::try_from(r.get::<i64, _>(0)).ok()))
    }

    /// Assigns `workspace_id` the lowest uid in `first..end` that no workspace holds and
    /// returns it (or the uid it already has); `None` when every one is held. Safe across
    /// processes: the uid is unique in the table, so of two racing inserts one fails and
    /// tries the next free uid.
    pub async fn assign_uid(
        &self,
        workspace_id: &str,
        first: u32,
        end: u64,
    ) -> Result<Option<u32>> {
        for _ in 0..16 {
            if let Some(uid) = self.workspace_uid(workspace_id).await? {
                return Ok(Some(uid));
            }
            let Some(uid) = self.lowest_free_uid(first, end).await? else {
                return Ok(None);
            };
            let res = sqlx::query(
                "INSERT INTO sandbox_uids (workspace_id, uid, assigned_at) VALUES (?1, ?2, ?3) \
                 ON CONFLICT DO NOTHING",
            )
            .bind(workspace_id)
            .bind(i64::from(uid))
            .bind(now())
            .execute(&self.pool)
            .await?;
            if res.rows_affected() == 1 {
                return Ok(Some(uid));
            }
        }
        Err(StoreError::Db(sqlx::Error::Protocol(
            "sandbox uid assignment kept racing".into(),
        )))
    }

    /// The lowest uid in `first..end` no workspace holds, the one the next new workspace
    /// gets.
    pub async fn lowest_free_uid(&self, first: u32, end: u64) -> Result<Option<u32>> {
        let held =
            sqlx::query("SELECT uid FROM sandbox_uids WHERE uid >= ?1 AND uid < ?2 ORDER BY uid")
                .bind(i64::from(first))
                .bind(i64::try_from(end).unwrap_or(i64::MAX))
                .fetch_all(&self.pool)
                .await?;
        let mut free = u64::from(first);
        for r in &held {
            let uid = u64::try_from(r.get::<i64, _>(0)).unwrap_or(0);
            if uid == free {
                free += 1;
            } else if uid > free {
                break;
            }
        }
        Ok(u32::try_from(free).ok().filter(|_| free < end))
    }

    /// Forgets the uid of `workspace_id`.
    pub async fn release_uid(&self, workspace_id: &str) -> Result<()> {
        sqlx::query("DELETE FROM sandbox_uids WHERE workspace_id = ?1")
            .bind(workspace_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Uid assignments made before `cutoff` (RFC 3339): workspace id and uid.
    pub async fn uid_assignments_before(&self, cutoff: &str) -> Result<Vec<(String, u32)>> {
        let rows = sqlx::query("SELECT workspace_id, uid FROM sandbox_uids WHERE assigned_at < ?1")
            .bind(cutoff)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows
            .iter()
            .filter_map(|r| Some((r.get(0), u32::try_from(r.get::<i64, _>(1)).ok()?)))
            .collect())
    }

    /// Records (or replaces) a suspended session: its create request, its info and the
    /// seconds of lifetime it has left.
    pub async fn put_suspended(
        &self,
        req: &CreateSessionRequest,
        info: &SessionInfo,
        remaining_seconds: u64,
    ) -> Result<()> {
        sqlx::query(
            "INSERT INTO suspended_sessions (session_id, task_id, request_json, info_json, \
             remaining_seconds, suspended_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
             ON CONFLICT (session_id) DO UPDATE SET request_json = ?3, info_json = ?4, \
             remaining_seconds = ?5, suspended_at = ?6",
        )
        .bind(&req.session_id)
        .bind(&req.task_id)
        .bind(serde_json::to_string(req)?)
        .bind(serde_json::to_string(info)?)
        .bind(i64::try_from(remaining_seconds).unwrap_or(i64::MAX))
        .bind(now())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Forgets a suspended session (resumed or ended).
    pub async fn delete_suspended(&self, session_id: &str) -> Result<()> {
        sqlx::query("DELETE FROM suspended_sessions WHERE session_id = ?1")
            .bind(session_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Every suspended session: request, info and seconds of lifetime left.
    pub async fn suspended(&self) -> Result<Vec<(CreateSessionRequest, SessionInfo, u64)>> {
        let rows = sqlx::query(
            "SELECT request_json, info_json, remaining_seconds FROM suspended_sessions \
             ORDER BY suspended_at",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    serde_json::from_str(&r.get::<String, _>(0))?,
                    serde_json::from_str(&r.get::<String, _>(1))?,
                    u64::try_from(r.get::<i64, _>(2)).unwrap_or(0),
                ))
            })
            .collect()
    }

    /// Records a snapshot.
    pub async fn insert_snapshot(&self, s: &SnapshotInfo) -> Result<()> {
        sqlx::query(
            "INSERT INTO session_snapshots (snapshot_id, task_id, session_id, info_json, bytes, \
             expires_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )
        .bind(&s.snapshot_id)
        .bind(&s.task_id)
        .bind(&s.session_id)
        .bind(serde_json::to_string(s)?)
        .bind(i64::try_from(s.bytes).unwrap_or(i64::MAX))
        .bind(&s.expires_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// One snapshot, if known.
    pub async fn snapshot(&self, snapshot_id: &str) -> Result<Option<SnapshotInfo>> {
        let row = sqlx::query("SELECT info_json FROM session_snapshots WHERE snapshot_id = ?1")
            .bind(snapshot_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row
            .map(|r| serde_json::from_str(&r.get::<String, _>(0)))
            .transpose()?)
    }

    /// The snapshots of a session, oldest first.
    pub async fn snapshots_of(&self, session_id: &str) -> Result<Vec<SnapshotInfo>> {
        let rows = sqlx::query(
            "SELECT info_json FROM session_snapshots WHERE session_id = ?1 ORDER BY rowid",
        )
        .bind(session_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| Ok(serde_json::from_str(&r.get::<String, _>(0))?))
            .collect()
    }

    /// How many snapshots a task holds, and their bytes.
    pub async fn snapshot_usage_of_task(&self, task_id: &str) -> Result<(u64, u64)> {
        let row = sqlx::query(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM session_snapshots WHERE task_id = ?1",
        )
        .bind(task_id)
        .fetch_one(&self.pool)
        .await?;
        Ok((
            u64::try_from(row.get::<i64, _>(0)).unwrap_or(0),
            u64::try_from(row.get::<i64, _>(1)).unwrap_or(0),
        ))
    }

    /// Snapshots whose `expires_at` (RFC 3339) is before `now`.
    pub async fn expired_snapshots(&self, now: &str) -> Result<Vec<String>> {
        let rows = sqlx::query("SELECT snapshot_id FROM session_snapshots WHERE expires_at < ?1")
            .bind(now)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| r.get::<String, _>(0)).collect())
    }

    /// Every snapshot id recorded.
    pub async fn snapshot_ids(&self) -> Result<Vec<String>> {
        let rows = sqlx::query("SELECT snapshot_id FROM session_snapshots")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| r.get::<String, _>(0)).collect())
    }

    /// Forgets a snapshot; whether it was known.
    pub async fn delete_snapshot(&self, snapshot_id: &str) -> Result<bool> {
        let res = sqlx::query("DELETE FROM session_snapshots WHERE snapshot_id = ?1")
            .bind(snapshot_id)
            .execute(&self.pool)
            .await?;
        Ok(res.rows_affected() == 1)
    }

    /// The database answers.
    pub async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }
}

fn decode(r: &sqlx::sqlite::SqliteRow) -> Result<JobRecord> {
    let mode: String = r.get("mode");
    let response: Option<String> = r.get("response_json");
    let request: RunJobRequest = serde_json::from_str(&r.get::<String, _>("request_json"))?;
    let digest: Option<String> = r.get("request_digest");
    let request_digest = match digest {
        Some(d) => d,
        None => request_digest(&request)?,
    };
    Ok(JobRecord {
        job_id: r.get("job_id"),
        task_id: r.get("task_id"),
        mode: if mode == "sync" {
            Mode::Sync
        } else {
            Mode::Async
        },
        state: parse_state(&r.get::<String, _>("state"))?,
        request,
        request_digest,
        response: response.map(|s| serde_json::from_str(&s)).transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_canonical_and_tells_requests_apart() {
        let a = req("a");
        let same: RunJobRequest = serde_json::from_str(
            r#"{"sandbox":{"command":["true"],"image":"i"},"job_id":"a","task_id":"t","version":1}"#,
        )
        .unwrap();
        assert_eq!(request_digest(&a).unwrap(), request_digest(&same).unwrap());
        let mut other = req("a");
        other.task_id = "t2".into();
        assert_ne!(request_digest(&a).unwrap(), request_digest(&other).unwrap());
        let mut other = req("a");
        other.sandbox.command = vec!["false".into()];
        assert_ne!(request_digest(&a).unwrap(), request_digest(&other).unwrap());
    }

    fn req(id: &str) -> RunJobRequest {
        serde_json::from_value(serde_json::json!({
            "version": 1, "task_id": "t", "job_id": id,
            "sandbox": { "image": "i", "command": ["true"] }
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn insert_is_idempotent_and_states_move_forward() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("w.db")).await.unwrap();
        assert!(store.insert(&req("a"), Mode::Async).await.unwrap());
        assert!(!store.insert(&req("a"), Mode::Async).await.unwrap());
        store
            .set_state("a", AsyncJobState::InProgress)
            .await
            .unwrap();
        assert_eq!(store.unfinished().await.unwrap().len(), 1);
        let got = store.get("a").await.unwrap().unwrap();
        assert_eq!(
            (got.state, got.mode),
            (AsyncJobState::InProgress, Mode::Async)
        );
        assert_eq!(got.request_digest, request_digest(&req("a")).unwrap());
        assert!(store.delete("a").await.unwrap());
        assert!(store.get("a").await.unwrap().is_none());
    }
}
