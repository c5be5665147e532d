package pgshard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// split groups rs by shard: each part's reservations in rs's order, and
// where each of rs went. A reservation of a partition being moved goes to
// no part (loc.part -1): it fails alone, with ErrMoving.
func (s *Store) split(rs []store.Reservation) ([]part, []loc) {
	var parts []part
	where := make([]loc, len(rs))
	byShard := map[int]int{} // shard index -> its part
	for i, r := range rs {
		if s.moving[r.Partition] {
			where[i] = loc{-1, 0}
			continue
		}
		sh := s.index(r.Partition)
		p, ok := byShard[sh]
		if !ok {
			p = len(parts)
			byShard[sh] = p
			parts = append(parts, part{shard: s.shards[sh], index: sh})
		}
		where[i] = loc{p, len(parts[p].rs)}
		parts[p].rs = append(parts[p].rs, r)
	}
	return parts, where
}

// part is a batch's reservations on one shard.
type part struct {
	shard *postgres.Store
	index int // in New's shards, for errors
	rs    []store.Reservation
	res   []store.Entry
	tx    store.BatchTx // BeginBatch's, nil if it acquired nothing
	err   error
}

// loc is where a reservation of a batch went: its part (-1 for none: its
// partition is being moved), and its index there.
type loc struct{ part, i int }

// outcome is a batch's error and entries from its parts': nil if every
// reservation was decided; a plain error if none was; else a
// *store.PartialError naming those whose part failed or that went to none.
func outcome(parts []part, where []loc) ([]store.Entry, error) {
	var errs []error
	for _, p := range parts {
		if p.err != nil {
			errs = append(errs, fmt.Errorf("shard %d: %w", p.index, p.err))
		}
	}
	failed := make([]bool, len(where))
	n, moving := 0, false
	for i, l := range where {
		if l.part < 0 {
			failed[i], moving = true, true
		} else {
			failed[i] = parts[l.part].err != nil
		}
		if failed[i] {
			n++
		}
	}
	if moving {
		errs = append(errs, ErrMoving)
	}
	err := errors.Join(errs...)
	switch {
	case n > 0 && n == len(where):
		return nil, err
	case n > 0:
		err = &store.PartialError{Err: err, Failed: failed}
	}
	res := make([]store.Entry, len(where))
	for i, l := range where {
		if !failed[i] {
			res[i] = parts[l.part].res[l.i]
		}
	}
	return res, err
}

// each runs f for every part, at once, and waits.
func each(parts []part, f func(p *part)) {
	if len(parts) == 1 {
		f(&parts[0])
		return
	}
	var wg sync.WaitGroup
	for i := range parts {
		wg.Go(func() { f(&parts[i]) })
	}
	wg.Wait()
}

// ReserveBatch implements store.BatchReserver: each shard's reservations
// in one ReserveBatch of its own, the shards at once. The reservations of
// a shard that fails, or of a tenant being moved, fail alone: the others
// stand, and the error is a *store.PartialError. If all fail, so does the
// batch, with a plain error.
func (s *Store) ReserveBatch(ctx context.Context, rs []store.Reservation) ([]store.Entry, error) {
	parts, where := s.split(rs)
	each(parts, func(p *part) {
		t := s.timer(ctx, p.index, opReserveBatch)
		p.res, p.err = p.shard.ReserveBatch(ctx, p.rs)
		t.end(ctx, p.err)
	})
	return outcome(parts, where)
}

// BeginBatch implements store.BatchAtomic: the reservations of each shard
// in a transaction of its own on it, the shards at once. A batch on one
// shard is that shard's BatchTx; across shards, a BatchTx that routes each
// call to its shard's transaction and commits them one after another
// (batchTx.Commit). The reservations of a shard that fails, or of a tenant
// being moved, fail alone: the others stand in the transactions of their
// shards, and the error is a *store.PartialError. If all fail, so does the
// batch, with a plain error.
func (s *Store) BeginBatch(ctx context.Context, rs []store.Reservation) ([]store.Entry, store.BatchTx, error) {
	parts, where := s.split(rs)
	each(parts, func(p *part) {
		t := s.timer(ctx, p.index, opBeginBatch)
		p.res, p.tx, p.err = p.shard.BeginBatch(ctx, p.rs)
		t.end(ctx, p.err)
		if p.err != nil && p.tx != nil {
			_ = p.tx.Rollback(ctx) // if it fails, the database rolls back as it closes the connection
			p.tx = nil
		}
	})
	res, err := outcome(parts, where)
	if res == nil {
		return nil, nil, err
	}
	if len(parts) == 1 && err == nil {
		return res, parts[0].tx, nil // its indexes are the batch's
	}
	tx := &batchTx{where: where}
	for _, p := range parts {
		tx.txs, tx.shards = append(tx.txs, p.tx), append(tx.shards, p.index)
	}
	if !slices.ContainsFunc(tx.txs, func(t store.BatchTx) bool { return t != nil }) {
		return res, nil, err // no shard acquired a key
	}
	return res, tx, err
}

// batchTx is a batch's transactions on several shards, one each (nil on a
// shard where the batch acquired no key, or that failed).
type batchTx struct {
	txs    []store.BatchTx
	shards []int // the index of each's shard, for errors
	where  []loc
}

var errNoTx = errors.New("idemkey pgshard: the batch acquired no key on this call's shard")

func (t *batchTx) tx(i int) (store.BatchTx, int, error) {
	if i < 0 || i >= len(t.where) {
		return nil, 0, fmt.Errorf("idemkey pgshard: the batch has no call %d", i)
	}
	l := t.where[i]
	if l.part < 0 || t.txs[l.part] == nil {
		return nil, 0, errNoTx
	}
	return t.txs[l.part], l.i, nil
}

// HandlerContext implements store.BatchTx: call i's shard's.
func (t *batchTx) HandlerContext(ctx context.Context, i int) context.Context {
	tx, j, err := t.tx(i)
	if err != nil {
		return ctx // a call that holds no key: the engine runs no handler for it
	}
	return tx.HandlerContext(ctx, j)
}

// Record implements store.BatchTx on call i's shard.
func (t *batchTx) Record(ctx context.Context, i int, outcome []byte, keepWrites bool) error {
	tx, j, err := t.tx(i)
	if err != nil {
		return err
	}
	return tx.Record(ctx, j, outcome, keepWrites)
}

// Release implements store.BatchTx on call i's shard.
func (t *batchTx) Release(ctx context.Context, i int) error {
	tx, j, err := t.tx(i)
	if err != nil {
		return err
	}
	return tx.Release(ctx, j)
}

// Commit implements store.BatchTx: each shard's transaction commits in
// turn. At the first that fails, the rest roll back and its error is
// returned; the shards committed before it stay committed, each message
// with its record, so that a redelivery replays those and runs the rest
// once (store.ErrLeaseLost: the engine serves each call again alone).
func (t *batchTx) Commit(ctx context.Context) error {
	var err error
	for k, tx := range t.txs {
		if tx == nil {
			continue
		}
		if err != nil {
			_ = tx.Rollback(ctx)
			continue
		}
		if err = tx.Commit(ctx); err != nil {
			err = fmt.Errorf("idemkey pgshard: the commit on shard %d (%d of the batch's %d): %w", t.shards[k], k+1, len(t.txs), err)
		}
	}
	return err
}

// Rollback implements store.BatchTx on every shard.
func (t *batchTx) Rollback(ctx context.Context) error {
	var errs []error
	for _, tx := range t.txs {
		if tx != nil {
			errs = append(errs, tx.Rollback(ctx))
		}
	}
	return errors.Join(errs...)
}

// Err implements store.BatchTx: the first shard's transaction that ended
// before Commit. The engine then rolls every shard back.
func (t *batchTx) Err() error {
	for _, tx := range t.txs {
		if tx != nil {
			if err := tx.Err(); err != nil {
				return err
			}
		}
	}
	return nil
}
