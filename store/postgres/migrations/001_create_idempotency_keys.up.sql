-- One row per idempotency key scope. Rows are keyed by the SHA-256 of the
-- length-prefixed scope (tenant, method, key): raw keys and tenant ids are
-- never stored, and every index entry has the same small size.
CREATE SEQUENCE idempotency_keys_token_seq AS bigint;

CREATE TABLE idempotency_keys (
    key         bytea       PRIMARY KEY CHECK (octet_length(key) = 32),
    fingerprint bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    state       text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    -- Fencing token of the current holder, from idempotency_keys_token_seq:
    -- never handed out twice, even after a row is deleted and reinserted.
    token       bigint      NOT NULL,
    lease_end   timestamptz NOT NULL,
    -- The encoded idemkey.v1.Outcome once completed.
    outcome     bytea,
    created_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    CHECK ((state = 'completed') = (outcome IS NOT NULL))
) WITH (fillfactor = 80); -- room on each page, so that completing a row is a HOT update

-- The sweeper finds expired rows through this index.
CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
