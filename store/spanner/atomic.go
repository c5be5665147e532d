package spanner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"cloud.google.com/go/spanner"
	"cloud.google.com/go/spanner/apiv1/spannerpb"

	"github.com/idemkey/idemkey/store"
)

var _ store.Atomic = (*Store)(nil)

type txKey struct{}

// TxFromContext returns the read-write transaction of the atomic call that
// ctx belongs to; ok is false outside one (a method in two-phase mode, or a
// call without an idempotency key). The handler reads and writes through
// it (Query, Update, BufferWrite) and never commits or rolls it back: the
// engine commits it with the key's record, or rolls it back.
func TxFromContext(ctx context.Context) (tx *spanner.ReadWriteStmtBasedTransaction, ok bool) {
	tx, ok = ctx.Value(txKey{}).(*spanner.ReadWriteStmtBasedTransaction)
	return tx, ok
}

// atomicOptions are the handler's transaction's: serializable, and begun
// with its first statement, so that a handler that has not read or written
// yet holds no transaction open.
var atomicOptions = spanner.TransactionOptions{
	IsolationLevel:         spannerpb.TransactionOptions_SERIALIZABLE,
	BeginTransactionOption: spanner.InlinedBeginTransaction,
}

// Begin implements store.Atomic. It reserves the key as Reserve does, in a
// transaction of its own, so that a duplicate is told "in progress" at once
// and Lookup sees the run; then it opens the handler's read-write
// transaction, which Commit commits with the record. A run that dies leaves
// the reservation in progress until its lease ends, as in two-phase mode,
// and none of its writes: its retry runs once.
func (s *Store) Begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	res, err := s.Reserve(ctx, r)
	if err != nil || res.State != store.Acquired {
		return res, nil, err
	}
	txn, err := spanner.NewReadWriteStmtBasedTransactionWithOptions(ctx, s.client, atomicOptions)
	if err != nil {
		s.Release(ctx, r.Key, res.Token)
		return store.Entry{}, nil, s.translate(ctx, "begin", err)
	}
	return res, &atomicTx{store: s, txn: txn, key: r.Key, token: res.Token}, nil
}

// atomicTx is the store.Tx of Begin.
type atomicTx struct {
	store *Store
	key   store.Key
	token store.Token
	mu    sync.Mutex
	txn   *spanner.ReadWriteStmtBasedTransaction // nil once ended
}

var errTxEnded = errors.New("idemkey spanner: the transaction has already ended")

// HandlerContext implements store.Tx: TxFromContext finds the transaction
// in the context it returns.
func (t *atomicTx) HandlerContext(ctx context.Context) context.Context {
	t.mu.Lock()
	defer t.mu.Unlock()
	return context.WithValue(ctx, txKey{}, t.txn)
}

func (t *atomicTx) end() *spanner.ReadWriteStmtBasedTransaction {
	t.mu.Lock()
	defer t.mu.Unlock()
	txn := t.txn
	t.txn = nil
	return txn
}

// Commit implements store.Tx: in the handler's transaction, a read of the
// key's record (still held by this run's token, else store.ErrLeaseLost
// and nothing commits), and the commit that carries the record with the
// handler's writes. Spanner has no savepoints: without keepWrites the
// transaction rolls back and the record is written as Complete writes it.
//
// A commit that fails commits nothing of the handler's (an ABORTED
// transaction, or one the emulator ended): the reservation is released, so
// that the client's retry runs the handler once more, in a new
// transaction, and Commit returns store.ErrUnavailable. An outcome over a
// cell's 10 MiB is store.ErrFull, and the transaction stays open, so that
// the engine commits its stand-in instead. Commit does not run
// the handler's transaction again itself: the handler's function cannot be
// called from here, and its writes are gone with the transaction.
func (t *atomicTx) Commit(ctx context.Context, outcome []byte, keepWrites bool) error {
	if len(outcome) > maxCell {
		return errTooLarge // the transaction stays open, for the engine's stand-in
	}
	txn := t.end()
	if txn == nil {
		return errTxEnded
	}
	s := t.store
	ctx, cancel := s.bound(context.WithoutCancel(ctx))
	defer cancel()
	if !keepWrites {
		txn.Rollback(ctx)
		return s.Complete(ctx, t.key, t.token, outcome)
	}
	if outcome == nil {
		outcome = []byte{} // NULL means "in progress"
	}
	now, recs, err := s.readRecords(ctx, txn, t.key)
	if err == nil && !recs[0].heldBy(t.token, now) {
		txn.Rollback(ctx)
		return fmt.Errorf("idemkey spanner: commit: %w: the reservation was taken over, so nothing of this call was committed", store.ErrLeaseLost)
	}
	if err == nil {
		err = txn.BufferWrite([]*spanner.Mutation{spanner.Update(s.table, []string{"key", "outcome"}, []any{t.key[:], outcome})})
	}
	if err == nil {
		_, err = txn.Commit(ctx)
		if err == nil {
			return nil
		}
	} else {
		txn.Rollback(ctx)
	}
	// Nothing committed, or the commit's fate is unknown. The release is
	// fenced: if the commit did take effect, the record is completed and
	// stays.
	if relErr := s.Release(ctx, t.key, t.token); relErr != nil && !errors.Is(relErr, store.ErrLeaseLost) {
		s.opts.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey spanner: releasing an atomic call whose commit failed failed; the key is free when its lease ends")
	}
	return fmt.Errorf("idemkey spanner: commit: %w: the transaction was aborted or lost, and a retry runs the handler again (%w)", store.ErrUnavailable, s.translate(ctx, "commit", err))
}

// Rollback implements store.Tx: the handler's writes are dropped, and the
// reservation released.
func (t *atomicTx) Rollback(ctx context.Context) error {
	txn := t.end()
	if txn == nil {
		return errTxEnded
	}
	ctx, cancel := t.store.bound(context.WithoutCancel(ctx))
	defer cancel()
	txn.Rollback(ctx)
	if err := t.store.Release(ctx, t.key, t.token); err != nil && !errors.Is(err, store.ErrLeaseLost) {
		return err
	}
	return nil
}
