package reliability_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
)

// fault is one fault the harness injected, and whether it checked that the
// fault really happened.
type fault struct {
	kind     string
	verified bool
	detail   string
	recovery time.Duration // from the fault's end until every server answered OK
	at       time.Time     // when the fault began
}

// The kinds of fault, each a method of harness.
const (
	killServer          = "SIGKILL of a server process, then a restart"
	terminateInReserve  = "pg_terminate_backend of a server's session during a reservation"
	terminateInComplete = "pg_terminate_backend of a server's session during a record (two-phase) or mid-handler (atomic)"
	crashPostgres       = "immediate shutdown of PostgreSQL, then a restart"
	lockHotRows         = "locks on hot rows and the charges table, held past statement_timeout"
	storeUnreachable    = "PostgreSQL stopped for 2s (the store unreachable)"
	terminateIdle       = "pg_terminate_backend of every idle pooled session of the servers"
	longestDeadline     = "calls with the longest deadline a client can send, and their duplicates"
)

var faultKinds = []string{killServer, terminateInReserve, terminateInComplete, crashPostgres, lockHotRows, storeUnreachable, terminateIdle, longestDeadline}

func (h *harness) inject(kind string, n int) fault {
	f := fault{kind: kind, at: time.Now()}
	var err error
	switch kind {
	case killServer:
		err = h.killServer(n % servers)
	case terminateInReserve:
		f.detail, err = again(func() (string, error) { return h.terminateInReserve(n % servers) })
	case terminateInComplete:
		f.detail, err = again(func() (string, error) { return h.terminateInComplete(n % servers) })
	case crashPostgres:
		err = h.restartPostgres("immediate", 500*time.Millisecond)
	case lockHotRows:
		f.detail, err = h.lockHotRows()
	case storeUnreachable:
		f.detail, err = h.storeUnreachable()
	case terminateIdle:
		f.detail, err = again(h.terminateIdle)
	case longestDeadline:
		f.detail, err = again(func() (string, error) { return h.longestDeadline(n % servers) })
	}
	f.verified = err == nil
	if err != nil {
		f.detail = err.Error()
	}
	f.recovery = h.recoveryTime()
	return f
}

// again runs a fault that must catch a server statement in the act up to
// three times: on a loaded machine the statement may end before the harness
// finds it.
func again(inject func() (string, error)) (string, error) {
	var (
		detail string
		err    error
	)
	for range 3 {
		if detail, err = inject(); !errors.Is(err, errNotCaught) {
			break
		}
	}
	return detail, err
}

var errNotCaught = errors.New("no server statement was caught in the act")

func (h *harness) killServer(i int) error {
	s := h.server(i)
	err := s.Kill()
	h.keepLogs(s.Logs())
	time.Sleep(300 * time.Millisecond)
	h.setServer(i, h.startServer(i))
	return err
}

// terminateInReserve makes a call wait on its key: an uncommitted row of the
// harness holds it. In two-phase mode the reservation waits; in atomic mode,
// which holds keys with advisory locks, the handler runs and its record,
// sent with COMMIT, waits. Then it terminates the waiting session.
func (h *harness) terminateInReserve(i int) (string, error) {
	ctx := context.Background()
	key := idemkey.NewKey()
	scope := store.ScopeKey("acme", paymentsv1.PaymentService_CreateCharge_FullMethodName, key)
	tx, err := h.cluster.admin.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO idempotency_keys (key, fingerprint, state, token, lease_end, created_at, expires_at)
		VALUES ($1, $2, 'in_progress', 0, now() + interval '1 minute', now(), now() + interval '1 hour')`, scope[:], make([]byte, 32)); err != nil {
		return "", err
	}
	// Only now in the history, where the clients pick operations to send
	// again: one of them sending it first would take the key before the
	// harness's row does.
	o := h.newOp("acme", key)
	done := make(chan struct{})
	go func() { h.call(o, i, callTimeout); close(done) }()
	defer func() { <-done }()
	statement := `query LIKE '%WITH ins AS%'` // Reserve's, for a key with no record
	if h.atomic {
		statement = `query LIKE 'INSERT INTO idempotency_keys%'` // the record of an atomic call
	}
	pid, err := h.waitBackend(`wait_event_type = 'Lock' AND ` + statement)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("backend %d", pid), h.terminate(pid)
}

// terminateInComplete, in two-phase mode, holds the row of a call in progress
// so that its record waits, and terminates the waiting session; in atomic
// mode, it terminates the session of a call whose handler is running inside
// its transaction.
func (h *harness) terminateInComplete(i int) (string, error) {
	ctx := context.Background()
	o := h.newOp("globex", idemkey.NewKey())
	scope := store.ScopeKey(o.tenant, paymentsv1.PaymentService_CreateCharge_FullMethodName, o.key)
	done := make(chan struct{})
	go func() { h.call(o, i, callTimeout); close(done) }()
	defer func() { <-done }()
	if h.atomic {
		pid, err := h.waitBackend(`state = 'idle in transaction'`)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("backend %d, mid-handler", pid), h.terminate(pid)
	}
	tx, err := h.cluster.admin.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(ctx)
	for deadline := time.Now().Add(time.Second); ; time.Sleep(time.Millisecond) {
		tag, err := tx.Exec(ctx, `SELECT FROM idempotency_keys WHERE key = $1 AND state = 'in_progress' FOR UPDATE`, scope[:])
		if err != nil {
			return "", err
		}
		if tag.RowsAffected() == 1 {
			break
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("%w: the call's reservation never showed in progress", errNotCaught)
		}
	}
	pid, err := h.waitBackend(`wait_event_type = 'Lock' AND query LIKE '%SET state = ''completed''%'`)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("backend %d, in the record", pid), h.terminate(pid)
}

// waitBackend returns the pid of a server session that matches cond.
func (h *harness) waitBackend(cond string) (int32, error) {
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		var pid int32
		err := h.cluster.admin.QueryRow(context.Background(), `SELECT pid FROM pg_stat_activity
			WHERE application_name LIKE 'idemkey-server-%' AND `+cond+` LIMIT 1`).Scan(&pid)
		if err == nil {
			return pid, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return 0, err
		}
	}
	return 0, fmt.Errorf("%w: no server session matched %s", errNotCaught, cond)
}

// terminate ends a session and checks that it is gone.
func (h *harness) terminate(pid int32) error {
	ctx := context.Background()
	var ok bool
	if err := h.cluster.admin.QueryRow(ctx, `SELECT pg_terminate_backend($1, 5000)`, pid).Scan(&ok); err != nil || !ok {
		return fmt.Errorf("pg_terminate_backend(%d) = %v, %v", pid, ok, err)
	}
	var n int
	if err := h.cluster.admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n); err != nil || n != 0 {
		return fmt.Errorf("backend %d still there after pg_terminate_backend (%v)", pid, err)
	}
	return nil
}

// restartPostgres stops the cluster in mode, checks that it is down, waits
// down, and starts it again.
func (h *harness) restartPostgres(mode string, down time.Duration) error {
	if err := h.cluster.stop(mode); err != nil {
		return err
	}
	if h.cluster.accepting() {
		return errors.New("PostgreSQL still accepts connections after pg_ctl stop")
	}
	time.Sleep(down)
	return h.cluster.start()
}

// lockHotRows locks the most recent idempotency records and the charges
// table for longer than the servers' statement_timeout, and checks that a
// server statement waited on them.
func (h *harness) lockHotRows() (string, error) {
	ctx := context.Background()
	tx, err := h.cluster.admin.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(ctx)
	tag, err := tx.Exec(ctx, `SELECT FROM idempotency_keys ORDER BY created_at DESC LIMIT 100 FOR UPDATE`)
	if err != nil {
		return "", err
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE charges IN SHARE MODE`); err != nil {
		return "", err
	}
	waited := 0
	for end := time.Now().Add(1500 * time.Millisecond); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		var n int
		if err := h.cluster.admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name LIKE 'idemkey-server-%' AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
			return "", err
		}
		waited = max(waited, n)
	}
	if waited == 0 {
		return "", errors.New("no server statement waited on the locks")
	}
	return fmt.Sprintf("%d rows locked; up to %d server statements waited", tag.RowsAffected(), waited), tx.Rollback(ctx)
}

// storeUnreachable stops PostgreSQL for 2s. Calls made meanwhile must fail
// closed: Unavailable from idemkey (IDEMPOTENCY_STORE_UNAVAILABLE), never an
// answer from the handler.
func (h *harness) storeUnreachable() (string, error) {
	if err := h.cluster.stop("fast"); err != nil {
		return "", err
	}
	if h.cluster.accepting() {
		return "", errors.New("PostgreSQL still accepts connections after pg_ctl stop")
	}
	closed, other := 0, 0
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		for i := range servers {
			r := h.call(h.newOp("acme", idemkey.NewKey()), i, callTimeout)
			if r.reason == idemkey.ReasonStoreUnavailable {
				closed++
			} else {
				other++
			}
		}
	}
	h.mu.Lock()
	h.unguarded += other
	h.mu.Unlock()
	if err := h.cluster.start(); err != nil {
		return "", err
	}
	if other > 0 {
		return "", fmt.Errorf("%d calls during the outage were not refused by idemkey", other)
	}
	return fmt.Sprintf("%d calls failed closed", closed), nil
}

// terminateIdle terminates every server session idle in its pool, as a
// database restart, a failover or a pooler restart does to connections the
// pool still holds: the servers' next statements on them fail.
func (h *harness) terminateIdle() (string, error) {
	var n int
	err := h.cluster.admin.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
		FROM pg_stat_activity WHERE application_name LIKE 'idemkey-server-%' AND state = 'idle'`).Scan(&n)
	if err == nil && n == 0 {
		err = fmt.Errorf("%w: no idle server session", errNotCaught)
	}
	return fmt.Sprintf("%d idle sessions terminated", n), err
}

// longestDeadline sends a few new operations with the longest deadline a
// client can set (grpc-go sends it as grpc-timeout 2562047H), each with a
// duplicate on the other server while it runs, and checks that the lease
// each record got lies within idemkey's bounds: a wrapped lease once let the
// duplicate run the handler again. Atomic mode stores no lease (a running
// call holds a lock, and its record is written completed), so there it
// checks that the records were written.
func (h *harness) longestDeadline(i int) (string, error) {
	const n = 5
	var wg sync.WaitGroup
	ops := make([]*op, n)
	for j := range ops {
		ops[j] = h.newOp("acme", idemkey.NewKey())
		wg.Go(func() { h.call(ops[j], i, math.MaxInt64) })
		wg.Go(func() { time.Sleep(10 * time.Millisecond); h.call(ops[j], (i+1)%servers, math.MaxInt64) })
	}
	wg.Wait()
	longest := time.Duration(0)
	for _, o := range ops {
		scope := store.ScopeKey(o.tenant, paymentsv1.PaymentService_CreateCharge_FullMethodName, o.key)
		var micros int64
		err := h.cluster.admin.QueryRow(context.Background(),
			`SELECT (extract(epoch FROM lease_end - created_at) * 1e6)::bigint FROM idempotency_keys WHERE key = $1`, scope[:]).Scan(&micros)
		lease := time.Duration(micros) * time.Microsecond
		if errors.Is(err, pgx.ErrNoRows) {
			continue // released: the call failed (say, a server being restarted)
		}
		if err != nil {
			return "", err
		}
		if h.atomic {
			longest = max(longest, time.Nanosecond)
			continue
		}
		if lease <= 0 || lease > engine.DefaultMaxLease {
			return "", fmt.Errorf("a call with the longest deadline got a lease of %v", lease)
		}
		longest = max(longest, lease)
	}
	if longest == 0 {
		return "", fmt.Errorf("%w: none of %d calls with the longest deadline left a record", errNotCaught, n)
	}
	if h.atomic {
		return "records written, no lease stored", nil
	}
	return fmt.Sprintf("leases up to %v", longest.Round(time.Second)), nil
}
