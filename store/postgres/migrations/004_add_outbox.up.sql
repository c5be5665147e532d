-- The outbox (package outbox): messages a handler's transaction wrote, one
-- row each, for a relay to send to a broker once the transaction commits.
-- A message's id derives from the call's key and its place in the call, so
-- that a re-run's copy conflicts with the first and is dropped here.
CREATE TABLE idempotency_keys_outbox (
    id            text        PRIMARY KEY,
    -- The order messages were written in: a partition's are sent in it.
    seq           bigint      GENERATED ALWAYS AS IDENTITY,
    partition_key text        NOT NULL,
    destination   text        NOT NULL,
    -- The headers and payload, as package outbox encodes (and seals) them.
    body          bytea       NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- An unsent message is claimable from then: a relay's claim or a
    -- failed send's backoff moves it on.
    not_before    timestamptz NOT NULL DEFAULT now(),
    attempts      integer     NOT NULL DEFAULT 0,
    -- When a broker confirmed it; NULL until then.
    sent_at       timestamptz
);

-- The relay claims unsent messages in order, each partition's oldest; the
-- sweeper finds sent ones. Each name fits PostgreSQL's 63 bytes for a table
-- name of 48.
CREATE INDEX idempotency_keys_outbox_pending ON idempotency_keys_outbox (seq) WHERE sent_at IS NULL;
CREATE INDEX idempotency_keys_outbox_order ON idempotency_keys_outbox (partition_key, seq) WHERE sent_at IS NULL;
CREATE INDEX idempotency_keys_outbox_sent ON idempotency_keys_outbox (sent_at) WHERE sent_at IS NOT NULL;
