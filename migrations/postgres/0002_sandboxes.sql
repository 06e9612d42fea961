-- Sandboxes (a worker's sessions offered through the PM's API) and their snapshots, each
-- with its tenant (PostgreSQL). Kept in step with migrations/sqlite/0002_sandboxes.sql.
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id TEXT PRIMARY KEY NOT NULL,
    tenant_id  TEXT NOT NULL,
    worker_id  TEXT NOT NULL,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_tenant ON sandboxes (tenant_id);
CREATE TABLE IF NOT EXISTS sandbox_snapshots (
    snapshot_id TEXT PRIMARY KEY NOT NULL,
    tenant_id   TEXT NOT NULL,
    worker_id   TEXT NOT NULL,
    sandbox_id  TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
