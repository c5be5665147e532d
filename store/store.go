// Package store defines the contract between the idemkey engine (package
// engine, behind every entry point) and the durable record of each
// idempotency key.
//
// A record moves through two states. Reserve inserts it "in progress" under a
// lease and a fencing token before the handler runs; Complete stores the
// outcome, or Release deletes the record so that a retry runs the handler
// again. Both are fenced: they succeed only for the token that holds the
// record, so a caller whose lease was taken over cannot overwrite the reply of
// the caller that took it over.
//
// A record expires once its retention has passed and it holds no live lease,
// and from then on counts as absent. A store whose engine expires records
// natively (store/redis) deletes them itself; one that implements Sweeper
// (store/memory, store/postgres) deletes them when Sweep is called, which a
// Janitor does periodically in a goroutine of yours.
//
// A store that implements Atomic as well (store/postgres) can also commit the
// handler's own writes together with the record, in one transaction; one that
// implements Finder can replay a retried call with a read alone; one that
// implements Watcher (store/memory, store/redis, and store/postgres while
// its Listen runs) tells a waiting duplicate the moment the key it waits
// for is recorded.
//
// Every implementation passes the conformance suite in package storetest:
// store/memory (one process), store/postgres (any number of processes on
// one database) and store/redis (one Redis node or a Redis Cluster).
package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"time"
)

// Key identifies one record: the SHA-256 of the length-prefixed scope
// (tenant, method, idempotency key). Stores keep only the hash, so raw keys and
// tenant ids are never written anywhere.
type Key [sha256.Size]byte

// ScopeKey hashes a scope into a Key. Each part is length-prefixed, so no two
// different scopes share an encoding. method may be empty for a scope that
// spans methods.
func ScopeKey(tenant, method, idempotencyKey string) Key {
	return sha256.Sum256(AppendParts(make([]byte, 0, 512), tenant, method, idempotencyKey))
}

// String returns a short hex prefix of the hash, enough to correlate log lines.
func (k Key) String() string { return hex.EncodeToString(k[:6]) }

// Fingerprint is a hash of the request a key was first used with.
type Fingerprint [sha256.Size]byte

// Token is a fencing token. A store never hands out the same token twice for
// one key, so a token identifies one holder of one reservation.
type Token int64

// State is what Reserve found.
type State int

const (
	// Acquired: the caller holds the key and must run the handler, then call
	// Complete or Release with Entry.Token.
	Acquired State = iota + 1
	// Completed: an outcome is recorded; Entry.Outcome holds it.
	Completed
	// Held: another caller holds a live lease on the key (the key is in
	// progress).
	Held
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

// Partition names the tenant of a record without naming it: see
// TenantPartition. The zero Partition is that of a call without a tenant.
type Partition [8]byte

// TenantPartition returns the partition of tenant's records: the first 8
// bytes of the SHA-256 of the length-prefixed tenant, or the zero Partition
// for the empty tenant. Being derived from the tenant alone, it tells which
// records share a tenant, so a store keeps it in its own memory only and
// never writes it out.
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
	// Lease is how long the caller holds the key before another caller with the
	// same fingerprint may presume it dead and take the key over.
	Lease time.Duration
	// Retention is how long the record lives, counted from its creation.
	Retention time.Duration
	// MaxOutcome is the most bytes the outcome recorded under this
	// reservation may take (the engine's WithMaxRecordSize), or 0 if the
	// caller does not say. A store with a bound on bytes (store/memory)
	// acquires a key only with that much room free, and sets it aside until
	// Complete, which counts the outcome's real size and frees the rest, or
	// Release, which frees it all: every call it lets run can record its
	// reply, and the calls it has no room for are refused before they run. A
	// store without such a bound (store/postgres, store/redis) ignores it.
	MaxOutcome int
	// Partition is the tenant of the call (TenantPartition). A store with
	// bounds may give each partition only a share of them, so that one tenant
	// cannot fill the store for every other (store/memory); other stores
	// ignore it.
	Partition Partition
}

// Entry is what a store reports of a key: its record as Reserve, Find or
// Begin finds or makes it.
type Entry struct {
	State State
	// Token fences Complete and Release. Set when State is Acquired.
	Token Token
	// Fingerprint of the request that created the record. Set when State is
	// Completed or Held, so the caller can refuse a reused key.
	Fingerprint Fingerprint
	// Outcome is the recorded outcome when State is Completed. The caller must
	// not modify it.
	Outcome []byte
	// RetryAfter is how long the current lease has left when State is
	// Held.
	RetryAfter time.Duration
	// Expires is when the record expires (its creation plus its retention,
	// on the store's clock), in every state: until then its key is honoured.
	// It is the same for every answer about one record, so that every
	// transport tells a client the same instant. A store may leave it zero
	// for a key in progress whose expiry it cannot know (store/postgres: one
	// held by an atomic call whose session it cannot read); the entry points
	// then tell no expiry rather than a guessed one.
	Expires time.Time
}

// Errors that callers branch on with errors.Is. Implementations wrap them.
var (
	// ErrLeaseLost: Complete or Release was called with a token that no longer
	// holds the key (the lease was taken over, the record released, expired or
	// already completed). Nothing was written.
	ErrLeaseLost = errors.New("idemkey store: lease lost")
	// ErrUnavailable: the store could not be reached or did not answer in time.
	// The operation may or may not have taken effect.
	ErrUnavailable = errors.New("idemkey store: unavailable")
	// ErrFull: Reserve or Complete would pass a bound the store was given
	// (store/memory: records or bytes, in all or for one partition). Nothing
	// was written; records already completed still replay.
	ErrFull = errors.New("idemkey store: full")
	// ErrDataLost: the store has lost records, or can no longer rule out
	// that it loses them (store/redis: its data was flushed, failed over to
	// an empty replica or evicted, the server may evict, or a key of its own
	// that must never expire was given an expiry), so an absent
	// record no longer means a new key. Rather than run recorded keys again,
	// the store fails the operation, and nothing was written; the error says
	// what happened and what to do. Callers treat it as a failure, not an
	// answer: the engine answers "store unavailable".
	ErrDataLost = errors.New("idemkey store: data lost")
)

// SmallOutcome is the size of outcome that a store with bounds always
// accepts in Complete, so that a call whose reply found no room can still
// record a short error in its place.
const SmallOutcome = 256

// DefaultSweepBatch is the batch size Sweep uses when given one below 1.
const DefaultSweepBatch = 1000

// Store records the first outcome of each idempotency key. Implementations are
// safe for concurrent use, and every decision about time (leases, expiry) uses
// the store's own clock.
//
// The engine calls Complete and Release after the handler, with a
// context detached from the caller's cancellation, so that a client that hangs
// up cannot leave its key in progress. A store whose writes can block must
// bound them with a timeout of its own.
//
// A record is expired once its retention has passed and it holds no live
// lease. An expired record counts as absent everywhere.
//
// Absent must mean absent: a store that knows it may have lost records it
// acknowledged (flushed, evicted) returns ErrDataLost from every method
// rather than report such a record as absent, which would run its key again.
type Store interface {
	// Reserve decides, in one atomic step, what a call with r.Key does:
	//   - no record, or an expired one: insert it in progress with a new token
	//     and the lease r.Lease; Acquired.
	//   - a completed record: Completed, with its outcome and fingerprint.
	//   - an in-progress record whose lease has not ended: Held, with its
	//     fingerprint and the lease time left.
	//   - an in-progress record whose lease has ended: if its fingerprint is
	//     r.Fingerprint, take it over with a new token and lease (Acquired);
	//     otherwise Held, so the caller refuses the reused key.
	// A retention that has passed counts as absent even when the record was
	// created with a different fingerprint. A store with bounds returns
	// ErrFull rather than insert a record past them, or acquire a key, new or
	// taken over, without room for a record of r.MaxOutcome bytes (see
	// Reservation).
	Reserve(ctx context.Context, r Reservation) (Entry, error)

	// Complete records outcome for the key held by token, which then replays
	// until the record expires. It returns ErrLeaseLost if token no longer
	// holds an in-progress record for key. The store may keep outcome, so the
	// caller must not modify it afterwards. A store with bounds accepts an
	// outcome of up to the reservation's MaxOutcome bytes (unless that is more
	// than it can hold at all). It may return ErrFull for a larger one that
	// would pass them, and then accepts, for the same token, an outcome of at
	// most SmallOutcome bytes.
	Complete(ctx context.Context, key Key, token Token, outcome []byte) error

	// Release deletes the in-progress record held by token, so the next call
	// with the key runs again. It returns ErrLeaseLost if token no longer holds
	// an in-progress record for key.
	Release(ctx context.Context, key Key, token Token) error
}

// Sweeper is implemented by stores that keep expired records until told to
// delete them (store/memory, store/postgres). A store without it expires
// records by itself (store/redis: the server's native expiry), and nothing
// needs to sweep it. Expired records count as absent either way: sweeping
// frees space, it decides nothing.
type Sweeper interface {
	// Sweep deletes every record expired at the time of the call, in batches of
	// at most batchSize (DefaultSweepBatch if batchSize < 1) so that live calls
	// are never held up for long, and returns how many it deleted.
	Sweep(ctx context.Context, batchSize int) (deleted int, err error)
}

// BatchReserver is implemented by stores that can reserve a batch of keys
// in one round trip (store/postgres): a message consumer in two-phase mode
// that takes its messages in batches claims each batch with one
// ReserveBatch, then runs, completes or releases each message's key as
// after Reserve.
type BatchReserver interface {
	// ReserveBatch decides each of rs as Reserve decides one; res[i] is
	// rs[i]'s answer. The keys of rs must be distinct. On an error, no
	// result is returned, and a key the batch may have acquired before it
	// failed stays in progress until its lease ends, as after a Reserve
	// whose answer was lost.
	ReserveBatch(ctx context.Context, rs []Reservation) (res []Entry, err error)
}

// Watcher is implemented by stores that can tell a duplicate when the call
// that holds its key has recorded or released it (store/memory: from its own
// Complete and Release; store/redis: pub/sub; store/postgres: LISTEN and
// NOTIFY), so that the duplicate the engine holds for the key
// (engine.WithInProgressWait) reads it again at once rather than at its next
// poll. The engine polls all the same, on the same schedule, for what a
// store cannot tell (a lease that ends, another process's write).
type Watcher interface {
	// Watch returns a channel that is closed once the record of key, which
	// another call holds, is completed, released or deleted, and stop, to
	// call once the channel is no longer read. It never blocks on the
	// store's storage. The engine takes a Watch before each read of the key
	// it waits for, so that a change after the read is told. If the record
	// is not held when Watch is called (completed, released, or its lease
	// ended), changed is closed already, so that a change between the
	// call's Reserve and its first Watch is not missed either; a store that
	// cannot tell without reading its storage leaves it open, and the
	// engine's first poll finds the change.
	Watch(key Key) (changed <-chan struct{}, stop func())
}

// Finder is implemented by stores that can read a completed record more
// cheaply than Reserve decides (store/postgres: a plain SELECT, and in atomic
// mode no transaction). The engine asks it first for a call that its
// transport marks as a later attempt (gRPC's grpc-previous-rpc-attempts, a
// broker's redelivery: engine.Attempt), whose first attempt has often
// completed, so that
// the replay costs a read. When it has not (the retry of an "in progress", or
// of an attempt that never reached the server), the read is spent in vain
// before the reservation.
type Finder interface {
	// Find returns the record of key if it is completed and not expired:
	// State Completed, with its fingerprint and outcome. For any other record,
	// or none, ok is false and the caller reserves as usual. Find never
	// writes, and decides nothing Reserve would not: a completed record stays
	// as it is until it expires.
	Find(ctx context.Context, key Key) (res Entry, ok bool, err error)
}

// Atomic is implemented by stores that can commit a handler's own writes and
// its recorded outcome in one transaction (store/postgres). The engine uses
// it for operations in atomic mode (engine.OperationSpec.Atomic). How the handler reaches the transaction
// is the store's own API: Tx.HandlerContext puts it in the handler's context.
type Atomic interface {
	// Begin starts a transaction and reserves r in it, deciding as Reserve
	// does. When the result is Acquired, tx holds the open transaction with the
	// reservation, and the caller must end it with exactly one of Commit or
	// Rollback. Otherwise tx is nil and no transaction is left open.
	//
	// Another caller may hold the key in a transaction that has not
	// committed yet. Begin does not wait for it: the result is Held
	// with r's own Fingerprint, because an uncommitted record's fingerprint
	// cannot be read, and a RetryAfter of r.Lease; a later Begin decides on
	// its record once it has committed, or acquires if it rolled back.
	Begin(ctx context.Context, r Reservation) (res Entry, tx Tx, err error)
}

// Tx is an acquired key of an atomic call: an open transaction that holds the
// reservation, in which the handler writes.
type Tx interface {
	// HandlerContext returns ctx carrying the transaction, for the handler.
	HandlerContext(ctx context.Context) context.Context
	// Commit records outcome and commits the transaction. With keepWrites
	// false, the handler's writes are undone first and only the record
	// commits: for a recorded error. Like Complete, it ignores ctx's
	// cancellation. It returns ErrLeaseLost if another caller recorded the
	// key after Begin (a store that writes the record only at commit, as
	// store/postgres does, learns of such a race only then): nothing was
	// committed, and the caller reads the key's record to answer. On another
	// error, nothing is committed; or, if the connection failed during the
	// commit, it is unknown whether everything was; either way a retry finds
	// the truth. (A handler that ended the transaction itself gets an error
	// too, after its writes may have committed.)
	Commit(ctx context.Context, outcome []byte, keepWrites bool) error
	// Rollback ends the transaction with nothing written, the reservation
	// included: the key is free again. It ignores ctx's cancellation.
	Rollback(ctx context.Context) error
}

// BatchAtomic is implemented by atomic stores that can decide a batch of
// atomic calls together, in one transaction (store/postgres): a message
// consumer that takes its messages in batches dedups each batch in one
// round trip, runs the handlers of the messages it acquired one after
// another in that transaction, each apart from the others, and commits
// their records with one COMMIT.
type BatchAtomic interface {
	Atomic
	// BeginBatch starts one transaction and decides each of rs in it as
	// Begin decides one; res[i] is rs[i]'s answer. The keys of rs must be
	// distinct. When any is Acquired, tx holds the open transaction, and the
	// caller must end it with exactly one of Commit or Rollback. Otherwise
	// tx is nil and no transaction is left open.
	BeginBatch(ctx context.Context, rs []Reservation) (res []Entry, tx BatchTx, err error)
}

// BatchTx is the transaction of a batch of atomic calls (BeginBatch): the
// acquired keys, whose handlers write in it one at a time. Each acquired
// call i runs as HandlerContext(ctx, i), its handler, then exactly one of
// Record(ctx, i, ...) or Release(ctx, i), before the next call's
// HandlerContext. A call's writes are its own: undone alone when it is
// released or records an error, while the other calls' stay. Nothing of
// any call is durable until Commit returns nil.
type BatchTx interface {
	// HandlerContext starts acquired call i and returns ctx carrying the
	// transaction, for its handler.
	HandlerContext(ctx context.Context, i int) context.Context
	// Record ends call i, to record outcome at Commit: with keepWrites false
	// its writes are undone first (a recorded error). On an error, nothing
	// will be recorded for call i and its writes are undone (a handler that
	// succeeded after a statement of its failed, say), and the other calls
	// go on; or, when the transaction itself failed or ended (Err), every
	// later method fails too.
	Record(ctx context.Context, i int, outcome []byte, keepWrites bool) error
	// Release ends call i with its writes undone and nothing to record: its
	// key is free once the transaction ends.
	Release(ctx context.Context, i int) error
	// Commit records every outcome passed to Record and commits, in one
	// step, ignoring ctx's cancellation. It returns ErrLeaseLost if another
	// caller recorded one of the keys after BeginBatch: nothing was
	// committed, and the caller decides those calls again one at a time.
	// On another error, nothing is committed; or, if the connection failed
	// during the commit, it is unknown whether everything was.
	Commit(ctx context.Context) error
	// Rollback ends the transaction with nothing written: every key is free
	// again. It ignores ctx's cancellation, and does nothing after Commit or
	// Rollback.
	Rollback(ctx context.Context) error
	// Err is what ended the transaction before Commit (its connection was
	// lost, a handler ended it), or nil. Once it is set, no call runs in the
	// transaction any more, every method fails, and nothing of the batch
	// commits; the caller decides its calls again one at a time.
	Err() error
}
