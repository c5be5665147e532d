DROP TABLE idempotency_keys;
DROP SEQUENCE idempotency_keys_token_seq;
