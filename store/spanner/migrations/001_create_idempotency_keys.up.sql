-- One row per idempotency key scope, keyed by the SHA-256 of the
-- length-prefixed scope (tenant, method, key): raw keys and tenant ids are
-- never stored, and the hashes spread the rows over every split.
CREATE TABLE idempotency_keys (
    key         BYTES(32) NOT NULL,
    fingerprint BYTES(32) NOT NULL,
    -- The fencing token: the commit timestamp of the transaction that
    -- reserved the key (never the same twice for one key), in microseconds
    -- times 1000, plus seq, the key's place in its batch.
    token       TIMESTAMP NOT NULL OPTIONS (allow_commit_timestamp = true),
    seq         INT64     NOT NULL,
    lease_end   TIMESTAMP NOT NULL,
    -- The encoded idemkey.v1.Outcome once completed; NULL in progress.
    outcome     BYTES(MAX),
    created_at  TIMESTAMP NOT NULL,
    expires_at  TIMESTAMP NOT NULL,
    -- When Spanner's own deletion (TTL) may take the row: its expiry, or
    -- its lease's end if later, so that a run held past the retention keeps
    -- its row. The store counts an expired row absent whether or not it is
    -- gone yet.
    gone_at     TIMESTAMP AS (GREATEST(expires_at, lease_end)) STORED,
) PRIMARY KEY (key), ROW DELETION POLICY (OLDER_THAN(gone_at, INTERVAL 0 DAY));

-- One row per recorded step of a key's run (engine.Step). It is no child of
-- the key's record: it outlives Release and a lease's end, and an atomic
-- run's steps have no record at all until it commits.
CREATE TABLE idempotency_keys_steps (
    key         BYTES(32) NOT NULL,
    name        STRING(MAX) NOT NULL,
    fingerprint BYTES(32) NOT NULL,
    -- The step's result; NULL while it is started and not finished.
    result      BYTES(MAX),
    expires_at  TIMESTAMP NOT NULL,
) PRIMARY KEY (key, name), ROW DELETION POLICY (OLDER_THAN(expires_at, INTERVAL 0 DAY));
