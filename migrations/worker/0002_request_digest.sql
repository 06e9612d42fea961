-- Idempotency is keyed on the request: sha256 of the canonical JSON of the request a job
-- was accepted with. NULL for jobs recorded before this column existed (their stored
-- request_json gives it).
ALTER TABLE jobs ADD COLUMN request_digest TEXT;
