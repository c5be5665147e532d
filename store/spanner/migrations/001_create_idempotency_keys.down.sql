DROP TABLE idempotency_keys_steps;
DROP TABLE idempotency_keys;
