package spanner

import (
	"context"
	"errors"
	"fmt"
	"time"

	"cloud.google.com/go/spanner"

	"github.com/idemkey/idemkey/store"
)

// Recorded steps (store.Stepper) live in the table "<table>_steps", one row
// per key and step name, and leases are renewed (store.Renewer) on the
// records' table. Each method is one read-write transaction of its own,
// never an atomic call's: a step's record must outlive the rollback of the
// handler's writes. A non-zero token is fenced as Complete is: the read of
// the key's record in the transaction that writes.

var (
	_ store.Stepper = (*Store)(nil)
	_ store.Renewer = (*Store)(nil)
)

// stepSQL reads, with the database's clock, the record of key @key and its
// step @name, each NULL where there is none.
const stepSQL = `SELECT CURRENT_TIMESTAMP(), r.outcome IS NOT NULL, r.token, r.seq, r.lease_end, r.expires_at,
	s.fingerprint, s.result IS NOT NULL, s.result, s.expires_at
FROM UNNEST([1]) AS one LEFT JOIN %[1]s AS r ON r.key = @key LEFT JOIN %[2]s AS s ON s.key = @key AND s.name = @name`

// step is what stepSQL reads: the key's record, and the step's.
type step struct {
	now     time.Time
	rec     record
	found   bool
	entry   store.StepEntry
	expires time.Time
}

// readStep reads the step name of key, and key's record, in txn.
func (s *Store) readStep(ctx context.Context, txn *spanner.ReadWriteTransaction, key store.Key, name string) (step, error) {
	var st step
	err := txn.Query(ctx, spanner.Statement{SQL: s.stepSQL, Params: map[string]any{"key": key[:], "name": name}}).Do(func(row *spanner.Row) error {
		var (
			completed, done          spanner.NullBool
			token, leaseEnd, expires spanner.NullTime
			stepExpires              spanner.NullTime
			seq                      spanner.NullInt64
			fingerprint              []byte
		)
		if err := row.Columns(&st.now, &completed, &token, &seq, &leaseEnd, &expires, &fingerprint, &done, &st.entry.Result, &stepExpires); err != nil {
			return err
		}
		st.rec = record{found: token.Valid, completed: completed.Bool, token: token.Time, seq: seq.Int64,
			leaseEnd: leaseEnd.Time, expires: expires.Time}
		st.found = stepExpires.Valid && stepExpires.Time.After(st.now)
		st.expires = stepExpires.Time
		copy(st.entry.Fingerprint[:], fingerprint)
		st.entry.State = store.StepStarted
		if done.Bool {
			st.entry.State = store.StepDone
		}
		return nil
	})
	return st, err
}

// fenced reports whether token may write key's steps: 0, an open atomic
// call's, or the holder of key's record in progress.
func (st step) fenced(token store.Token) bool { return token == 0 || st.rec.heldBy(token, st.now) }

// stepTx runs f in a read-write transaction on the step name of key, fenced
// by token, for op.
func (s *Store) stepTx(ctx context.Context, op string, key store.Key, token store.Token, name string, f func(st step) ([]*spanner.Mutation, error)) error {
	_, err := s.transact(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		st, err := s.readStep(ctx, txn, key, name)
		if err != nil {
			return err
		}
		if !st.fenced(token) {
			return errLeaseLost
		}
		ms, err := f(st)
		if err != nil {
			return err
		}
		return txn.BufferWrite(ms)
	})
	if errors.Is(err, store.ErrLeaseLost) {
		return fmt.Errorf("idemkey spanner: %s: %w", op, store.ErrLeaseLost)
	}
	if err != nil {
		return s.translate(ctx, op, err)
	}
	return nil
}

var stepColumns = []string{"key", "name", "fingerprint", "result", "expires_at"}

// StartStep implements store.Stepper in one read-write transaction. A start
// whose commit's answer was lost finds the step started when it runs again:
// its outcome is unknown to the run, which never runs it blind.
func (s *Store) StartStep(ctx context.Context, in store.StepStart) (store.StepEntry, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var res store.StepEntry
	err := s.stepTx(ctx, "start step", in.Key, in.Token, in.Name, func(st step) ([]*spanner.Mutation, error) {
		if st.found {
			res = st.entry
			return nil, nil
		}
		res = store.StepEntry{State: store.StepNew}
		// The step expires with the record it was started under, or its
		// lease's end if later; an atomic run's (token 0) after the retention.
		expires := st.now.Add(max(in.Retention, 0))
		if in.Token != 0 {
			expires = st.rec.expires
			if st.rec.leaseEnd.After(expires) {
				expires = st.rec.leaseEnd
			}
		}
		return []*spanner.Mutation{spanner.InsertOrUpdate(s.steps, stepColumns, []any{in.Key[:], in.Name, in.Fingerprint[:], nil, expires})}, nil
	})
	return res, err
}

// FinishStep implements store.Stepper, detached from ctx like Complete.
func (s *Store) FinishStep(ctx context.Context, key store.Key, token store.Token, name string, result []byte) error {
	ctx, cancel := s.bound(context.WithoutCancel(ctx))
	defer cancel()
	if result == nil {
		result = []byte{} // NULL means "started"
	}
	return s.stepTx(ctx, "finish step", key, token, name, func(st step) ([]*spanner.Mutation, error) {
		if !st.found {
			return nil, errLeaseLost
		}
		return []*spanner.Mutation{spanner.Update(s.steps, []string{"key", "name", "result"}, []any{key[:], name, result})}, nil
	})
}

// ForgetSteps implements store.Stepper, detached from ctx like Complete.
func (s *Store) ForgetSteps(ctx context.Context, key store.Key, token store.Token, names ...string) error {
	ctx, cancel := s.bound(context.WithoutCancel(ctx))
	defer cancel()
	return s.stepTx(ctx, "forget steps", key, token, "", func(step) ([]*spanner.Mutation, error) {
		if len(names) == 0 {
			return []*spanner.Mutation{spanner.Delete(s.steps, spanner.Key{key[:]}.AsPrefix())}, nil
		}
		ms := make([]*spanner.Mutation, len(names))
		for i, name := range names {
			ms[i] = spanner.Delete(s.steps, spanner.Key{key[:], name})
		}
		return ms, nil
	})
}

// Renew implements store.Renewer, detached from ctx like Complete: the
// lease ends lease after the database's now.
func (s *Store) Renew(ctx context.Context, key store.Key, token store.Token, lease time.Duration) error {
	return s.write(ctx, "renew", key, token, func(now time.Time) *spanner.Mutation {
		return spanner.Update(s.table, []string{"key", "lease_end"}, []any{key[:], now.Add(max(lease, 0))})
	})
}
