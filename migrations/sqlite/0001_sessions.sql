-- PM session state (SQLite). Kept in step with migrations/postgres/0001_sessions.sql.
CREATE TABLE IF NOT EXISTS sessions (
    session_id       TEXT PRIMARY KEY NOT NULL,
    tenant_id        TEXT NOT NULL,
    objective        TEXT NOT NULL,
    status           TEXT NOT NULL,
    record_json      TEXT NOT NULL,
    version          BIGINT NOT NULL,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL,
    lease_owner      TEXT,
    lease_expires_ms BIGINT
);
CREATE INDEX IF NOT EXISTS sessions_status ON sessions (status);
-- The journal: every model reply and dispatch decision is written here before it acts.
CREATE TABLE IF NOT EXISTS journal (
    session_id TEXT NOT NULL,
    seq        BIGINT NOT NULL,
    kind       TEXT NOT NULL,
    data_json  TEXT NOT NULL,
    created_at TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE IF NOT EXISTS artifacts (
    sha256     TEXT PRIMARY KEY NOT NULL,
    size_bytes BIGINT NOT NULL,
    location   TEXT NOT NULL,
    created_at TEXT NOT NULL
);
