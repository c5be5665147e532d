DROP TABLE idempotency_keys_outbox;
