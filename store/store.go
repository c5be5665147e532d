// Package store is the contract between the idemkey engine and the record
// of each key: Reserve takes a key under a lease and a fencing token, then
// Complete records the outcome or Release frees the key, both fenced by the
// token. Package storetest checks an implementation.
package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"time"
)

// Key is the SHA-256 of a record's scope: stores never keep a raw key or tenant.
type Key [sha256.Size]byte

// ScopeKey hashes a scope; method is empty for one that spans methods.
func ScopeKey(tenant, method, idempotencyKey string) Key {
	return sha256.Sum256(AppendParts(make([]byte, 0, 512), tenant, method, idempotencyKey))
}

// String returns a short hex prefix of the hash, for logs.
func (k Key) String() string { return hex.EncodeToString(k[:6]) }

// Fingerprint is a hash of the request a key was first used with.
type Fingerprint [sha256.Size]byte

// Token is a fencing token, never handed out twice for one key.
type Token int64

// State is what Reserve found.
type State int

const (
	Acquired  State = iota + 1 // the caller holds the key: run, then Complete or Release with Entry.Token
	Completed                  // an outcome is recorded, in Entry.Outcome
	Held                       // another caller holds a live lease: in progress
)

func (s State) String() string {
	switch s {
	case Acquired:
		return "acquired"
	case Completed:
		return "completed"
	case Held:
		return "in progress"
	}
	return "unknown"
}

// Partition names a record's tenant without naming it; zero for none.
type Partition [8]byte

// TenantPartition hashes tenant; a store keeps it in memory only.
func TenantPartition(tenant string) Partition {
	if tenant == "" {
		return Partition{}
	}
	sum := sha256.Sum256(AppendParts(make([]byte, 0, 64), tenant))
	return Partition(sum[:8])
}

// Reservation asks for a key.
type Reservation struct {
	Key         Key
	Fingerprint Fingerprint
	Lease       time.Duration // until a caller with the same fingerprint may take the key over
	Retention   time.Duration // how long the record lives, from its creation
	MaxOutcome  int           // the outcome's most bytes, or 0: a byte-bound store holds the room till Complete or Release
	Partition   Partition     // a store with bounds may give each tenant a share; a sharded one routes by it
}

// Entry is a key's record as Reserve, Find or Begin finds or makes it.
type Entry struct {
	State       State
	Token       Token         // when Acquired: fences Complete and Release
	Fingerprint Fingerprint   // when Completed or Held, to refuse a reused key
	Outcome     []byte        // when Completed; do not modify it
	RetryAfter  time.Duration // when Held: what the lease has left
	Expires     time.Time     // creation plus retention, store's clock; zero if a running key's is unknown
}

// Errors that callers branch on with errors.Is. Implementations wrap them.
var (
	// ErrLeaseLost: the token no longer holds the key; nothing was written.
	ErrLeaseLost = errors.New("idemkey store: lease lost")
	// ErrUnavailable: no answer in time; it may or may not have taken effect.
	ErrUnavailable = errors.New("idemkey store: unavailable")
	// ErrFull: Reserve or Complete would pass a bound; nothing was written.
	ErrFull = errors.New("idemkey store: full")
	// ErrDataLost: the store has lost records or cannot rule it out, so
	// absent no longer means new. Nothing was written.
	ErrDataLost = errors.New("idemkey store: data lost")
)

// SmallOutcome is the outcome size a store with bounds always accepts.
const SmallOutcome = 256

// DefaultSweepBatch is Sweep's batch size when given one below 1.
const DefaultSweepBatch = 1000

// Store records the first outcome of each key, safe for concurrent use, on
// its own clock. A record past its retention without a live lease is absent;
// a store that may have lost records returns ErrDataLost rather than report
// one absent. Complete and Release get a context without the caller's
// cancellation. The engine's context of every call of this package's
// interfaces carries its call's Partition (PartitionFromContext); a batch's
// carries none, its reservations each their own.
type Store interface {
	// Reserve decides atomically: no record (or an expired one), Acquired
	// with a new token; a completed one, Completed; a live lease, Held; an
	// ended lease, Acquired if its fingerprint is r.Fingerprint, else Held.
	// ErrFull rather than pass a bound or lack room for r.MaxOutcome bytes.
	Reserve(ctx context.Context, r Reservation) (Entry, error)
	// Complete records outcome, which the store may keep, for the key token
	// holds in progress, else ErrLeaseLost. Past the reservation's MaxOutcome
	// it may return ErrFull, and then accepts SmallOutcome bytes.
	Complete(ctx context.Context, key Key, token Token, outcome []byte) error
	// Release deletes the record token holds in progress, else ErrLeaseLost.
	Release(ctx context.Context, key Key, token Token) error
}

// Sweeper is a store that keeps expired records until Sweep deletes them.
type Sweeper interface {
	// Sweep deletes them, and expired steps' records (Stepper), in batches
	// of batchSize and returns how many.
	Sweep(ctx context.Context, batchSize int) (deleted int, err error)
}

// BatchReserver is a store that reserves a batch of keys in one round trip.
type BatchReserver interface {
	// ReserveBatch is Reserve for each of rs (distinct keys); res[i] answers
	// rs[i]. A store that can tell which of rs failed, and decided the
	// others, returns a *PartialError with res; one that cannot, a plain
	// error.
	ReserveBatch(ctx context.Context, rs []Reservation) (res []Entry, err error)
}

// PartialError is a batch call's error that holds for some of its
// reservations only: Failed[i] tells whether rs[i] failed (with Err); the
// others' entries stand, and BeginBatch's transaction holds them.
type PartialError struct {
	Err    error
	Failed []bool
}

func (e *PartialError) Error() string {
	n := 0
	for _, f := range e.Failed {
		if f {
			n++
		}
	}
	return fmt.Sprintf("idemkey store: %d of the batch's %d calls failed: %v", n, len(e.Failed), e.Err)
}

// Unwrap returns Err, so that errors.Is classifies the failed calls.
func (e *PartialError) Unwrap() error { return e.Err }

// Watcher is a store that tells a waiting duplicate when the key's holder ends.
type Watcher interface {
	// Watch returns a channel closed once key's record is not held (at once,
	// if it is not now and the store can tell), and stop; it never blocks.
	Watch(key Key) (changed <-chan struct{}, stop func())
}

// Finder is a store that reads a completed record more cheaply than Reserve.
type Finder interface {
	// Find returns key's completed, unexpired record, or ok false; no write.
	Find(ctx context.Context, key Key) (res Entry, ok bool, err error)
}

// Looker is a store that reads a key's record without reserving it, for a
// client that asks what became of its key (engine.Lookup).
type Looker interface {
	// Lookup returns key's unexpired record, writing nothing: Completed
	// with its Fingerprint, Outcome and Expires; or Held (in progress),
	// with its Fingerprint (zero if the store cannot read it), what its
	// lease has left in RetryAfter (0 if the lease has ended or is
	// unknown) and Expires (zero if unknown); ok is false without one.
	// steps are the names of key's finished, unexpired steps (Stepper), in
	// byte order, whether or not the key has a record (a step outlives
	// Release). A store that may have lost records returns ErrDataLost
	// rather than ok false, as Find does.
	Lookup(ctx context.Context, key Key) (res Entry, steps []string, ok bool, err error)
}

// Renewer is a store that extends the lease of a live run.
type Renewer interface {
	// Renew ends the lease that token holds on key in progress lease from
	// now, else returns ErrLeaseLost, writing nothing.
	Renew(ctx context.Context, key Key, token Token, lease time.Duration) error
}

// StepState is what StartStep found of a step.
type StepState uint8

const (
	StepNew     StepState = iota + 1 // no record: StartStep recorded the step started
	StepStarted                      // started by an earlier run and never finished: its outcome is unknown
	StepDone                         // finished: StepEntry.Result holds its result
)

// StepStart asks to start a step, by name, of the run that holds a key.
type StepStart struct {
	Key  Key
	Name string
	// Token is the run's, from Reserve; 0 for a run that holds the key by an
	// open Atomic transaction, which a store cannot fence.
	Token       Token
	Fingerprint Fingerprint   // the run's request: a step recorded for another is not this run's
	Retention   time.Duration // for Token 0, the step's life from now; else it expires with the key's record
}

// StepEntry is a step's record as StartStep found it.
type StepEntry struct {
	State       StepState
	Fingerprint Fingerprint // the request it was recorded for, when StepStarted or StepDone
	Result      []byte      // when StepDone; do not modify it
}

// StepKey is the key a step's result is sealed under (engine.Sealer), so
// that a sealed result opens only as key's step name. Stored results depend
// on it: it never changes.
func StepKey(key Key, name string) Key {
	return sha256.Sum256(AppendParts(make([]byte, 0, 64+len(name)), "idemkey step v1", string(key[:]), name))
}

// Stepper is a store that records the steps of a run (engine.Step): its
// effects outside its transaction, each under the key and its name. A
// step's record outlives Release and a lease's end, so that the key's next
// run finds it, and expires with the record it was started under. Each
// method with a non-zero token returns ErrLeaseLost, writing nothing,
// unless the token holds the key in progress; token 0 is the holder of an
// open Atomic transaction.
type Stepper interface {
	// StartStep returns the step's record if it has an unexpired one,
	// writing nothing; else it records the step started and returns
	// StepNew.
	StartStep(ctx context.Context, s StepStart) (StepEntry, error)
	// FinishStep records result, which the store may keep, as the result
	// of the started step name (a finished one's is replaced, so that a
	// write retried after a lost answer succeeds); ErrLeaseLost if it has no
	// record. Past a bound it may return ErrFull, writing nothing.
	FinishStep(ctx context.Context, key Key, token Token, name string, result []byte) error
	// ForgetSteps deletes the records of the steps named, or of every step
	// of key if none is: a later run starts them anew.
	ForgetSteps(ctx context.Context, key Key, token Token, names ...string) error
}

// Atomic is a store that commits a handler's writes with its record.
type Atomic interface {
	// Begin is Reserve in a new transaction, tx, which is nil unless
	// Acquired. A key another open transaction holds is Held at once, with
	// r's own Fingerprint (the other's cannot be read) and r.Lease to wait.
	Begin(ctx context.Context, r Reservation) (res Entry, tx Tx, err error)
}

// Tx is an atomic call's open transaction, holding its reservation.
type Tx interface {
	HandlerContext(ctx context.Context) context.Context // ctx carrying the transaction
	// Commit records outcome and commits (keepWrites false: without the
	// handler's writes), ignoring cancellation. ErrLeaseLost: another caller
	// recorded first. On an error nothing, or perhaps everything, committed.
	Commit(ctx context.Context, outcome []byte, keepWrites bool) error
	// Rollback writes nothing, ignoring ctx's cancellation: the key is free.
	Rollback(ctx context.Context) error
}

// BatchAtomic is a store that decides a batch of atomic calls in one transaction.
type BatchAtomic interface {
	Atomic
	// BeginBatch is Begin for each of rs (distinct keys) in one transaction;
	// res[i] answers rs[i]. tx is nil unless one is Acquired. A store that
	// can tell which of rs failed returns a *PartialError with res and tx,
	// which holds the others only; one that cannot, a plain error.
	BeginBatch(ctx context.Context, rs []Reservation) (res []Entry, tx BatchTx, err error)
}

// BatchTx is a batch's transaction: each acquired call i runs as
// HandlerContext, its handler, then one Record or Release, before the next.
type BatchTx interface {
	HandlerContext(ctx context.Context, i int) context.Context // starts call i
	// Record stages outcome for Commit (keepWrites false: undoing i's writes).
	Record(ctx context.Context, i int, outcome []byte, keepWrites bool) error
	Release(ctx context.Context, i int) error // undoes i's writes; nothing to record
	// Commit is Tx.Commit for every staged call.
	Commit(ctx context.Context) error
	// Rollback is Tx.Rollback; it does nothing after Commit or Rollback.
	Rollback(ctx context.Context) error
	// Err is what ended it before Commit: then every method fails.
	Err() error
}

type partitionKey struct{}

// partitionCtx carries a partition; Value hands itself over for
// partitionKey, so that neither putting nor reading one boxes it.
type partitionCtx struct {
	context.Context
	p Partition
}

func (c *partitionCtx) Value(key any) any {
	if key == (partitionKey{}) {
		return c
	}
	return c.Context.Value(key)
}

// ContextWithPartition is ctx carrying p, the partition of the call a store
// call is made for. The engine gives every store call its call's, so that a
// store routing by tenant (store/pgshard) can route the methods that take
// only a Key; a store that keeps nothing per tenant ignores it.
func ContextWithPartition(ctx context.Context, p Partition) context.Context {
	return &partitionCtx{ctx, p}
}

// PartitionFromContext returns the partition ContextWithPartition put in
// ctx, and whether there was one.
func PartitionFromContext(ctx context.Context) (Partition, bool) {
	c, ok := ctx.Value(partitionKey{}).(*partitionCtx)
	if !ok {
		return Partition{}, false
	}
	return c.p, true
}
