//! Durable session state in SQL: SQLite (the embedded default, a file) or PostgreSQL,
//! through sqlx's `Any` driver with migrations per dialect under `migrations/`.
//!
//! A session row holds the whole [`SessionRecord`](crate::session::SessionRecord) as JSON
//! plus a version for optimistic concurrency; the journal holds every model reply and
//! dispatch decision, written in the same transaction as the state change that follows
//! from it, so a crash at any point resumes without asking the model again for a reply it
//! already gave and without dispatching a job twice.
//!
//! Opening a new database is safe when several processes do it at once: SQLite's set-up
//! (WAL switch and migrations) runs under an exclusive `flock` on `<db>.lock` next to the
//! file, with a busy timeout on every connection; PostgreSQL's migrations run under a
//! session-level `pg_advisory_lock` held on the connection that migrates.
//!
//! A PostgreSQL that stops answering fails fast: a call waits at most
//! [`acquire_timeout`] (default [`DEFAULT_ACQUIRE_TIMEOUT`], 5 s; set
//! `CYNODE_DATASTORE_ACQUIRE_TIMEOUT_MS` to change it) for a connection, then fails with
//! [`StoreError::Db`], which the HTTP service answers with 503 problem+json naming the
//! datastore, instead of holding the request until its own timeout (408).

use std::time::Duration;

mod sandboxes;
pub use sandboxes::Owner;

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};

use crate::session::SessionRecord;

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("stored json: {0}")]
    Json(#[from] serde_json::Error),
    #[error("session {0} was changed concurrently")]
    Conflict(String),
    #[error("unsupported datastore `{0}`: use sqlite://PATH or postgres://…")]
    Unsupported(String),
    #[error("cannot read {param} {path}: {source}")]
    TlsFile {
        param: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot lock {path} for set-up: {source}")]
    Lock {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl StoreError {
    /// Whether retrying the same operation may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Db(_) => true,
            StoreError::Migrate(_) => false,
            StoreError::Json(_) => false,
            StoreError::Conflict(_) => false,
            StoreError::Unsupported(_) => false,
            StoreError::Lock { .. } => false,
            StoreError::TlsFile { .. } => false,
        }
    }
}

/// Crate-local result alias.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// One journal entry.
#[derive(Debug, Clone, PartialEq)]
pub struct JournalEntry {
    pub seq: i64,
    pub kind: String,
    pub data: serde_json::Value,
}

/// The session database.
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    postgres: bool,
}

/// One page of a session listing: the sessions and the cursor of the next page.
#[derive(Debug, Clone)]
pub struct Page {
    pub sessions: Vec<SessionRecord>,
    pub next_cursor: Option<String>,
}

static SQLITE: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");
static POSTGRES: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/postgres");

fn now() -> String {
    let t = time::OffsetDateTime::now_utc();
    let fmt = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    t.format(&fmt).unwrap_or_default()
}

/// How long a call waits for a database connection by default.
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// Environment variable overriding [`DEFAULT_ACQUIRE_TIMEOUT`], in milliseconds.
pub const ACQUIRE_TIMEOUT_ENV: &str = "CYNODE_DATASTORE_ACQUIRE_TIMEOUT_MS";

/// How long a call waits for a database connection (a reachable database hands one out
/// in milliseconds): `CYNODE_DATASTORE_ACQUIRE_TIMEOUT_MS` when it is a positive number,
/// else [`DEFAULT_ACQUIRE_TIMEOUT`].
pub fn acquire_timeout() -> Duration {
    std::env::var(ACQUIRE_TIMEOUT_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&ms| ms > 0)
        .map(Duration::from_millis)
        .unwrap_or(DEFAULT_ACQUIRE_TIMEOUT)
}

/// The `pg_advisory_lock` key the PM's migrations run under ("cynode" in ASCII).
const MIGRATION_LOCK_KEY: i64 = 0x6379_6e6f_6465;

/// An exclusive `flock` on a file beside the SQLite database, held while the database is
/// set up; released on drop (or when the process dies).
struct SetupLock {
    _file: std::fs::File,
}

impl SetupLock {
    async fn acquire(path: &str) -> Result<SetupLock> {
        let owned = path.to_string();
        let err = |source| StoreError::Lock {
            path: owned.clone(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(err)?;
        let locked = tokio::task::spawn_blocking(move || {
            use std::os::fd::AsRawFd;
            loop {
                // SAFETY: flock on a descriptor this closure owns (through `file`).
                if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                    return Ok(file);
                }
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        })
        .await
        .map_err(|e| err(std::io::Error::other(e.to_string())))?;
        Ok(SetupLock {
            _file: locked.map_err(err)?,
        })
    }
}

/// The TLS files a PostgreSQL URL names (`sslrootcert`, `sslcert`, `sslkey`) must be
/// readable: sqlx would only report "No such file or directory" without the path.
fn check_tls_files(url: &str) -> Result<()> {
    let Ok(parsed) = url::Url::parse(url) else {
        // sqlx reports a malformed URL itself.
        return Ok(());
    };
    for (param, path) in parsed.query_pairs() {
        let known = matches!(
            param.as_ref(),
            "sslrootcert"
                | "ssl-root-cert"
                | "ssl-ca"
                | "sslcert"
                | "ssl-cert"
                | "sslkey"
                | "ssl-key"
        );
        // sqlx also takes the PEM itself in place of a path.
        if known && !path.trim_start().starts_with("-----BEGIN") {
            if let Err(source) = std::fs::File::open(path.as_ref()) {
                return Err(StoreError::TlsFile {
                    param: param.into_owned(),
                    path: path.into_owned(),
                    source,
                });
            }
        }
    }
    Ok(())
}

impl Store {
    /// Connects to `url` (`sqlite://path` creating the file, or `postgres://…`) and migrates.
    /// A PostgreSQL URL may ask for TLS with libpq's `sslmode` (`require`, `verify-ca`,
    /// `verify-full`) and name a CA with `sslrootcert` (and a client certificate with
    /// `sslcert`/`sslkey`), e.g. `postgres://u@db:5432/d?sslmode=verify-full&sslrootcert=/ca.pem`.
    pub async fn connect(url: &str) -> Result<Store> {
        sqlx::any::install_default_drivers();
        let mut setup_lock = None;
        let (url, migrator) = if let Some(path) = url.strip_prefix("sqlite://") {
            if let Some(parent) = std::path::Path::new(path).parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            let file = path.split('?').next().unwrap_or(path);
            setup_lock = Some(SetupLock::acquire(&format!("{file}.lock")).await?);
            let sep = if path.contains('?') { "&" } else { "?" };
            (format!("sqlite://{path}{sep}mode=rwc"), &SQLITE)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            check_tls_files(url)?;
            (url.to_string(), &POSTGRES)
        } else {
            return Err(StoreError::Unsupported(url.to_string()));
        };
        let sqlite = url.starts_with("sqlite://");
        let mut options = AnyPoolOptions::new().max_connections(8);
        if !sqlite {
            // A PostgreSQL that stops answering fails calls fast (SQLite keeps sqlx's 30 s:
            // its connections wait on each other's write locks under load, not on a server).
            options = options.acquire_timeout(acquire_timeout());
        }
        let pool = options
            // Per connection: a PRAGMA run once on the pool reaches only one connection,
            // and the others then fail with "database is locked" under write contention
            // (200 concurrent sessions showed it).
            .after_connect(move |conn, _meta| {
                Box::pin(async move {
                    if sqlite {
                        sqlx::query("PRAGMA busy_timeout=30000")
                            .execute(&mut *conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await?;
        if sqlite {
            sqlx::query("PRAGMA journal_mode=WAL")
                .execute(&pool)
                .await?;
            migrator.run(&pool).await?;
        } else {
            // Replicas starting together: one migrates, the others wait for it here (the
            // lock is released when this connection goes back, at the latest when the
            // process dies).
            let mut conn = pool.acquire().await?;
            sqlx::query("SELECT pg_advisory_lock($1)")
                .bind(MIGRATION_LOCK_KEY)
                .execute(&mut *conn)
                .await?;
            let migrated = migrator.run(&mut *conn).await;
            let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(MIGRATION_LOCK_KEY)
                .execute(&mut *conn)
                .await;
            migrated?;
            unlocked?;
        }
        drop(setup_lock);
        let postgres = !sqlite;
        Ok(Store { pool, postgres })
    }

    /// Inserts a new session; false when the id exists.
    pub async fn create(&self, rec: &SessionRecord) -> Result<bool> {
        let at = now();
        let res = sqlx::query(
            "INSERT INTO sessions (session_id, tenant_id, objective, status, record_json, version, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, 1, $6, $7) ON CONFLICT (session_id) DO NOTHING",
        )
        .bind(rec.state.session_id.clone())
        .bind(rec.tenant_id.clone())
        .bind(rec.state.objective.clone())
        .bind(rec.status.as_str().to_string())
        .bind(serde_json::to_string(rec)?)
        .bind(at.clone())
        .bind(at)
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    /// The session and its version.
    pub async fn load(&self, session_id: &str) -> Result<Option<(SessionRecord, i64)>> {
        let row = sqlx::query("SELECT record_json, version FROM sessions WHERE session_id = $1")
            .bind(session_id.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| -> Result<(SessionRecord, i64)> {
            let text: String = r.try_get(0)?;
            Ok((serde_json::from_str(&text)?, r.try_get(1)?))
        })
        .transpose()
    }

    /// Saves `rec` if nobody changed it since `version`, appending `journal` entries in the
    /// same transaction. Returns the new version.
    pub async fn save(
        &self,
        rec: &SessionRecord,
        version: i64,
        journal: &[(&str, serde_json::Value)],
    ) -> Result<i64> {
        let mut tx = self.pool.begin().await?;
        let res = sqlx::query(
            "UPDATE sessions SET status = $1, record_json = $2, version = version + 1, updated_at = $3 \
             WHERE session_id = $4 AND version = $5",
        )
        .bind(rec.status.as_str().to_string())
        .bind(serde_json::to_string(rec)?)
        .bind(now())
        .bind(rec.state.session_id.clone())
        .bind(version)
        .execute(&mut *tx)
        .await?;
        if res.rows_affected() != 1 {
            return Err(StoreError::Conflict(rec.state.session_id.clone()));
        }
        if !journal.is_empty() {
            let next: i64 =
                sqlx::query("SELECT COALESCE(MAX(seq), 0) FROM journal WHERE session_id = $1")
                    .bind(rec.state.session_id.clone())
                    .fetch_one(&mut *tx)
                    .await?
                    .try_get(0)?;
            for (i, (kind, data)) in journal.iter().enumerate() {
                sqlx::query(
                    "INSERT INTO journal (session_id, seq, kind, data_json, created_at) VALUES ($1, $2, $3, $4, $5)",
                )
                .bind(rec.state.session_id.clone())
                .bind(next + 1 + i as i64)
                .bind(kind.to_string())
                .bind(serde_json::to_string(data)?)
                .bind(now())
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(version + 1)
    }

    /// The session's journal in order.
    pub async fn journal(&self, session_id: &str) -> Result<Vec<JournalEntry>> {
        let rows = sqlx::query(
            "SELECT seq, kind, data_json FROM journal WHERE session_id = $1 ORDER BY seq",
        )
        .bind(session_id.to_string())
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(entry).collect()
    }

    /// The latest journal entry of one kind (one indexed row, not the whole journal).
    pub async fn last_journal(&self, session_id: &str, kind: &str) -> Result<Option<JournalEntry>> {
        let row = sqlx::query(
            "SELECT seq, kind, data_json FROM journal WHERE session_id = $1 AND kind = $2 \
             ORDER BY seq DESC LIMIT 1",
        )
        .bind(session_id.to_string())
        .bind(kind.to_string())
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(entry).transpose()
    }

    /// Sessions, newest first, optionally with one status.
    pub async fn list(&self, status: Option<&str>) -> Result<Vec<SessionRecord>> {
        let rows =
            match status {
                Some(s) => sqlx::query(
                    "SELECT record_json FROM sessions WHERE status = $1 ORDER BY created_at DESC",
                )
                .bind(s.to_string())
                .fetch_all(&self.pool)
                .await?,
                None => {
                    sqlx::query("SELECT record_json FROM sessions ORDER BY created_at DESC")
                        .fetch_all(&self.pool)
                        .await?
                }
            };
        rows.iter()
            .map(|r| -> Result<SessionRecord> {
                Ok(serde_json::from_str(&r.try_get::<String, _>(0)?)?)
            })
            .collect()
    }

    /// Leases up to `limit` runnable sessions (status `running`, no lease or an expired one)
    /// to `owner` until `now + lease_ms`; returns their ids. PostgreSQL skips rows another
    /// replica is claiming at the same moment (`FOR UPDATE SKIP LOCKED`); SQLite serialises
    /// writers, which gives the same guarantee in one process.
    pub async fn claim(&self, owner: &str, lease_ms: i64, limit: i64) -> Result<Vec<String>> {
        let now = crate::session::now_ms();
        let lock = if self.postgres {
            " FOR UPDATE SKIP LOCKED"
        } else {
            ""
        };
        let sql = format!(
            "UPDATE sessions SET lease_owner = $1, lease_expires_ms = $2 WHERE session_id IN (\
             SELECT session_id FROM sessions WHERE status = 'running' \
             AND (lease_owner IS NULL OR lease_expires_ms < $3) \
             ORDER BY updated_at LIMIT $4{lock}) RETURNING session_id"
        );
        let rows = sqlx::query(&sql)
            .bind(owner.to_string())
            .bind(now + lease_ms)
            .bind(now)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| r.try_get::<String, _>(0).map_err(StoreError::from))
            .collect()
    }

    /// Extends `owner`'s lease on a session; false when the lease was lost (expired and
    /// taken by another replica, or released).
    pub async fn renew(&self, session_id: &str, owner: &str, lease_ms: i64) -> Result<bool> {
        let res = sqlx::query(
            "UPDATE sessions SET lease_expires_ms = $1 WHERE session_id = $2 AND lease_owner = $3",
        )
        .bind(crate::session::now_ms() + lease_ms)
        .bind(session_id.to_string())
        .bind(owner.to_string())
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    /// Gives a lease back (the session ended, parked, or the replica is stopping).
    pub async fn release(&self, session_id: &str, owner: &str) -> Result<()> {
        sqlx::query(
            "UPDATE sessions SET lease_owner = NULL, lease_expires_ms = NULL \
             WHERE session_id = $1 AND lease_owner = $2",
        )
        .bind(session_id.to_string())
        .bind(owner.to_string())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Releases every lease `owner` holds (a replica shutting down); returns how many.
    pub async fn release_all(&self, owner: &str) -> Result<u64> {
        let r = sqlx::query(
            "UPDATE sessions SET lease_owner = NULL, lease_expires_ms = NULL WHERE lease_owner = $1",
        )
        .bind(owner.to_string())
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected())
    }

    /// A tenant's sessions, newest first, `limit` per page. The cursor is opaque to callers
    /// (`created_at|session_id` of the last row).
    pub async fn page(
        &self,
        tenant: &str,
        status: Option<&str>,
        cursor: Option<&str>,
        limit: i64,
    ) -> Result<Page> {
        let (c_at, c_id) = cursor
            .and_then(|c| c.split_once('|'))
            .map(|(a, b)| (a.to_string(), b.to_string()))
            // "~" sorts after every timestamp and id: no cursor, from the newest.
            .unwrap_or_else(|| ("~".to_string(), "~".to_string()));
        let rows = sqlx::query(
            "SELECT record_json, created_at, session_id FROM sessions WHERE tenant_id = $1 \
             AND ($2 = '' OR status = $2) \
             AND (created_at < $3 OR (created_at = $3 AND session_id < $4)) \
             ORDER BY created_at DESC, session_id DESC LIMIT $5",
        )
        .bind(tenant.to_string())
        .bind(status.unwrap_or("").to_string())
        .bind(c_at)
        .bind(c_id)
        .bind(limit + 1)
        .fetch_all(&self.pool)
        .await?;
        let mut sessions = Vec::new();
        let mut next_cursor = None;
        for (i, r) in rows.iter().enumerate() {
            if i as i64 == limit {
                break;
            }
            sessions.push(serde_json::from_str(&r.try_get::<String, _>(0)?)?);
            if i as i64 == limit - 1 && rows.len() as i64 > limit {
                next_cursor = Some(format!(
                    "{}|{}",
                    r.try_get::<String, _>(1)?,
                    r.try_get::<String, _>(2)?
                ));
            }
        }
        Ok(Page {
            sessions,
            next_cursor,
        })
    }

    /// Where a verified artifact is stored.
    pub async fn artifact_location(&self, sha256: &str) -> Result<Option<String>> {
        let row = sqlx::query("SELECT location FROM artifacts WHERE sha256 = $1")
            .bind(sha256.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| r.try_get::<String, _>(0).map_err(StoreError::from))
            .transpose()
    }

    /// How many sessions have each status.
    pub async fn count_by_status(&self) -> Result<Vec<(String, i64)>> {
        let rows = sqlx::query("SELECT status, COUNT(*) FROM sessions GROUP BY status")
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get::<String, _>(0)?, r.try_get::<i64, _>(1)?)))
            .collect()
    }

    /// Runnable sessions no replica holds a live lease on.
    pub async fn unclaimed(&self) -> Result<i64> {
        let row = sqlx::query(
            "SELECT COUNT(*) FROM sessions WHERE status = 'running' \
             AND (lease_owner IS NULL OR lease_expires_ms < $1)",
        )
        .bind(crate::session::now_ms())
        .fetch_one(&self.pool)
        .await?;
        Ok(row.try_get::<i64, _>(0)?)
    }

    /// True when the database answers.
    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }

    /// Records a verified artifact's storage location (idempotent).
    pub async fn put_artifact(&self, sha256: &str, size: u64, location: &str) -> Result<()> {
        sqlx::query(
            "INSERT INTO artifacts (sha256, size_bytes, location, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (sha256) DO NOTHING",
        )
        .bind(sha256.to_string())
        .bind(i64::try_from(size).unwrap_or(i64::MAX))
        .bind(location.to_string())
        .bind(now())
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

fn entry(r: &AnyRow) -> Result<JournalEntry> {
    Ok(JournalEntry {
        seq: r.try_get(0)?,
        kind: r.try_get(1)?,
        data: serde_json::from_str(&r.try_get::<String, _>(2)?)?,
    })
}
