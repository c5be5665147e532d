-- One row per recorded step of a key's run (engine.Step): an effect outside
-- the handler's transaction, under the key's hash and the step's name. It
-- is no child of the key's record: it outlives Release and a lease's end,
-- so that the key's next run finds it, and an atomic run's steps have no
-- record at all until it commits.
CREATE TABLE idempotency_keys_steps (
    key         bytea       NOT NULL CHECK (octet_length(key) = 32),
    name        text        NOT NULL,
    -- The request the step was started for.
    fingerprint bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    -- The step's result; NULL while it is started and not finished.
    result      bytea,
    started_at  timestamptz NOT NULL,
    -- The key's record's expiry when the step started (an atomic run's: the
    -- retention from then). An expired step counts as absent.
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (key, name)
) WITH (fillfactor = 80); -- room on each page, so that finishing a step is a HOT update

-- The sweeper finds expired steps through this index. Its name fits
-- PostgreSQL's 63 bytes for a table name of 48.
CREATE INDEX idempotency_keys_steps_exp_idx ON idempotency_keys_steps (expires_at);
