-- Node-local job records: kept until the caller acks the job (or retention expires).
CREATE TABLE IF NOT EXISTS jobs (
    job_id        TEXT PRIMARY KEY NOT NULL,
    task_id       TEXT NOT NULL,
    mode          TEXT NOT NULL CHECK (mode IN ('sync', 'async')),
    state         TEXT NOT NULL,
    request_json  TEXT NOT NULL,
    response_json TEXT,
    created_at    TEXT NOT NULL,
    updated_at    TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state);
