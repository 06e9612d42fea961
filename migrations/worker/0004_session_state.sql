-- Sessions whose state outlives the node (worker/src/sessions/suspend.rs): a suspended
-- session is kept here until it is resumed, ended or expired; a restarted node loads it
-- again. `request_json` is the create request (re-checked on resume).
CREATE TABLE IF NOT EXISTS suspended_sessions (
    session_id   TEXT PRIMARY KEY NOT NULL,
    task_id      TEXT NOT NULL,
    request_json TEXT NOT NULL,
    info_json    TEXT NOT NULL,
    -- Seconds of the session's max lifetime left when it was suspended.
    remaining_seconds INTEGER NOT NULL,
    suspended_at TEXT NOT NULL
);

-- Snapshots of session workspaces (worker/src/sessions/snapshot.rs): the image is
-- <state>/snapshots/<snapshot_id>.img.
CREATE TABLE IF NOT EXISTS session_snapshots (
    snapshot_id  TEXT PRIMARY KEY NOT NULL,
    task_id      TEXT NOT NULL,
    session_id   TEXT NOT NULL,
    info_json    TEXT NOT NULL,
    bytes        INTEGER NOT NULL,
    expires_at   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS session_snapshots_task ON session_snapshots (task_id);
CREATE INDEX IF NOT EXISTS session_snapshots_session ON session_snapshots (session_id);
