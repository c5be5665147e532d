-- waited marks an in-progress record that a duplicate waits for, on a store
-- that runs Listen: the Complete or Release of a marked record notifies the
-- table's channel in the same statement, so that the duplicate is answered
-- at once. A record no duplicate waited for costs no notification. Adding a
-- column with a constant default rewrites nothing (PostgreSQL 11 and later).
ALTER TABLE idempotency_keys ADD COLUMN waited boolean NOT NULL DEFAULT false;
