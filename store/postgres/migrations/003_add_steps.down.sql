DROP TABLE idempotency_keys_steps;
