-- The host uid each workspace's sandboxes run as (config `sandbox_uids`, worker/src/uid_pool.rs):
-- a workspace keeps its uid for its life; two workspaces never share one.
CREATE TABLE IF NOT EXISTS sandbox_uids (
    workspace_id TEXT PRIMARY KEY NOT NULL,
    uid          INTEGER NOT NULL UNIQUE,
    assigned_at  TEXT NOT NULL
);
