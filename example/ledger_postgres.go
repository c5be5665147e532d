package example

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/idemkey/idemkey/outbox"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/postgres"
)

// chargesSchema is the example's own table. The unique constraint on
// (tenant, merchant_reference) is the second line of defence: it refuses a
// repeated charge even after its idempotency key has expired. An empty
// reference is stored as NULL, which the constraint does not compare.
// processor_charge_id is the card processor's id of the charge, empty if
// none was charged; a table of an earlier release gets it, under a lock
// taken only then.
const chargesSchema = `
CREATE TABLE IF NOT EXISTS charges (
	tenant             text        NOT NULL,
	id                 text        NOT NULL,
	customer_id        text        NOT NULL,
	amount             bigint      NOT NULL,
	currency           text        NOT NULL,
	description        text        NOT NULL,
	merchant_reference text,
	create_time        timestamptz NOT NULL,
	processor_charge_id text       NOT NULL DEFAULT '',
	PRIMARY KEY (tenant, id),
	CONSTRAINT charges_merchant_reference_key UNIQUE (tenant, merchant_reference)
);
CREATE INDEX IF NOT EXISTS charges_customer_page_idx ON charges (tenant, customer_id, create_time, id);
DO $$ BEGIN
	IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = 'charges'::regclass AND attname = 'processor_charge_id' AND NOT attisdropped) THEN
		ALTER TABLE charges ADD COLUMN processor_charge_id text NOT NULL DEFAULT '';
	END IF;
END $$`

// PostgresLedger is a Ledger on the table charges, in the database that also
// holds the idempotency keys.
type PostgresLedger struct {
	pool *pgxpool.Pool
	// outbox, if set (Announce), gets a message of each charge, to
	// destination.
	outbox      *outbox.Outbox
	destination string
}

// NewPostgresLedger returns a ledger on pool; MigrateLedger creates its table.
func NewPostgresLedger(pool *pgxpool.Pool) *PostgresLedger { return &PostgresLedger{pool: pool} }

// Announce makes Insert publish a ChargeCreated of each charge to
// destination through ob, in the transaction of the charge's INSERT: the
// call's in atomic mode, else one of Insert's own. The message exists if and
// only if the charge does, and its id derives from the call's key
// (outbox.Publish). Call it before the ledger is used.
func (l *PostgresLedger) Announce(ob *outbox.Outbox, destination string) {
	l.outbox, l.destination = ob, destination
}

// InTransaction returns a gRPC server interceptor that runs each call's
// handler in a transaction of its own on the ledger's database, which Insert
// joins (postgres.TxFromContext), and commits it if the handler succeeds:
// BEGIN, the charge's INSERT, COMMIT, in three round trips and one commit,
// as atomic mode's are. Without idempotency it is the fair baseline of
// atomic mode (make load's bare-tx), where an autocommitted INSERT needs
// one round trip.
func (l *PostgresLedger) InTransaction() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		err = pgx.BeginFunc(ctx, l.pool, func(tx pgx.Tx) error {
			resp, err = handler(postgres.ContextWithTx(ctx, tx), req)
			return err
		})
		return resp, err
	}
}

// MigrateLedger creates the charges table if it does not exist, or adds
// the columns it lacks. Replicas starting at once can collide in the
// catalog ("already exists", or a unique violation there) or deadlock on an
// upgrade's lock; the loser tries again and finds the table.
func MigrateLedger(ctx context.Context, pool *pgxpool.Pool) error {
	for attempt := 1; ; attempt++ {
		_, err := pool.Exec(ctx, chargesSchema)
		var pgErr *pgconn.PgError
		collided := errors.As(err, &pgErr) && (pgErr.Code == "23505" || pgErr.Code == "42P07" || pgErr.Code == "42710" || pgErr.Code == "42701" || pgErr.Code == "40P01")
		if !collided || attempt == 5 {
			return err
		}
	}
}

// insertTimeout bounds a charge's insert when the call's deadline does not
// end it sooner; see insertContext.
const insertTimeout = 5 * time.Second

// insertContext returns the context of a charge's insert. It is detached from
// the caller's cancellation, so that a client hanging up cannot cut a charge
// short and leave its outcome unknown; but it ends by the call's deadline, and
// by insertTimeout at the latest, so that the insert ends inside the call's
// idempotency lease: a handler still running when its lease ends may be run
// again elsewhere, and charge twice.
//
// With the engine's defaults this holds. A call with a deadline holds
// its lease until that deadline plus 5 s of grace, but for 10 minutes at most;
// a call without one holds it for a minute. The insert ends by the earlier of
// the call's deadline and insertTimeout after it starts, so it ends at least
// 5 s before the lease does if it starts within 50 s of the call (this
// handler starts it at once). A server that shortens the lease with
// engine.WithLease or engine.WithMaxLease must keep both well above
// insertTimeout.
func insertContext(ctx context.Context) (context.Context, context.CancelFunc) {
	deadline, ok := ctx.Deadline()
	if limit := time.Now().Add(insertTimeout); !ok || limit.Before(deadline) {
		deadline = limit
	}
	return context.WithDeadline(context.WithoutCancel(ctx), deadline)
}

// Insert implements Ledger. With Announce, the charge's INSERT and its
// message commit in one transaction.
func (l *PostgresLedger) Insert(ctx context.Context, tenant string, c *paymentsv1.Charge) error {
	tx, atomic := postgres.TxFromContext(ctx)
	ctx, cancel := insertContext(ctx)
	defer cancel()
	if atomic {
		// The insert and the message join the call's transaction, which
		// commits them with the recorded reply.
		if err := l.insert(ctx, tx, tenant, c); err != nil {
			return insertError(err)
		}
		return l.announce(ctx, tx, tenant, c)
	}
	// Otherwise the insert commits on its own, on a connection taken
	// first, so that failing to get one (the deadline passing while the
	// pool is busy) is known to have made no charge.
	conn, err := l.pool.Acquire(ctx)
	if err != nil {
		return ledgerError(err)
	}
	defer conn.Release()
	if l.outbox == nil {
		return insertError(l.insert(ctx, conn, tenant, c))
	}
	// With a message, in a transaction of Insert's own that both join.
	// Until its commit, whatever fails leaves no charge: the key is
	// released for a retry.
	own, err := conn.Begin(ctx)
	if err != nil {
		return ledgerError(err)
	}
	defer func() { _ = own.Rollback(context.WithoutCancel(ctx)) }() // after Commit, a no-op
	if err := l.insert(ctx, own, tenant, c); err != nil {
		if err := insertError(err); err == errDuplicateReference {
			return err
		}
		return ledgerError(err)
	}
	if err := l.announce(ctx, own, tenant, c); err != nil {
		return err
	}
	return insertError(own.Commit(ctx))
}

// insert writes c through db.
func (l *PostgresLedger) insert(ctx context.Context, db postgres.Querier, tenant string, c *paymentsv1.Charge) error {
	var ref *string
	if r := c.GetMerchantReference(); r != "" {
		ref = &r
	}
	_, err := db.Exec(ctx, `INSERT INTO charges
		(tenant, id, customer_id, amount, currency, description, merchant_reference, create_time, processor_charge_id)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
		tenant, c.GetId(), c.GetCustomerId(), c.GetAmount(), c.GetCurrency(), c.GetDescription(), ref, c.GetCreateTime().AsTime(), c.GetProcessorChargeId())
	return err
}

// announce publishes c's ChargeCreated through tx, with Announce.
func (l *PostgresLedger) announce(ctx context.Context, tx postgres.Querier, tenant string, c *paymentsv1.Charge) error {
	if l.outbox == nil {
		return nil
	}
	payload, err := json.Marshal(ChargeCreated{ID: c.GetId(), Tenant: tenant, Amount: c.GetAmount(), Currency: c.GetCurrency()})
	if err == nil {
		err = l.outbox.Publish(postgres.ContextWithTx(ctx, tx), outbox.Message{Destination: l.destination, Headers: map[string]string{"tenant": tenant}, Payload: payload})
	}
	if err != nil {
		// The transaction is rolled back: no charge, and the key is
		// released for a retry.
		return ledgerError(err)
	}
	return nil
}

// insertError answers an insert's, or its transaction's, err.
func insertError(err error) error {
	var pgErr *pgconn.PgError
	refused := errors.As(err, &pgErr) // the server answered with an error
	switch {
	case err == nil:
		return nil
	case refused && pgErr.ConstraintName == "charges_merchant_reference_key":
		return errDuplicateReference
	case refused || pgconn.SafeToRetry(err):
		// The database refused the insert, or it never left this process:
		// no charge was made, so the key is released for a retry.
		return ledgerError(err)
	default:
		// The connection failed after the insert (or its commit) was sent,
		// or the call's deadline cut it short (pgx then closes the
		// connection rather than wait for the server): the charge may
		// exist. Unknown is recorded, so a retry cannot charge again; the
		// caller can look for the charge with ListCharges. (In atomic mode
		// the transaction died with the connection, so the commit fails
		// and the caller gets Unavailable: the retry runs again.)
		return status.Error(codes.Unknown, "the charge's outcome is unknown: look for it with ListCharges before charging again")
	}
}

// Get implements Ledger.
func (l *PostgresLedger) Get(ctx context.Context, tenant, id string) (*paymentsv1.Charge, error) {
	rows, _ := l.pool.Query(ctx, selectCharges+` WHERE tenant = $1 AND id = $2`, tenant, id)
	c, err := pgx.CollectExactlyOneRow(rows, scanCharge)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errNoSuchCharge
	}
	return c, ledgerError(err)
}

// List implements Ledger. It reads one row past the page, to learn whether
// another page follows.
func (l *PostgresLedger) List(ctx context.Context, tenant, customerID string, after Position, limit int) ([]*paymentsv1.Charge, Position, error) {
	rows, _ := l.pool.Query(ctx, selectCharges+` WHERE tenant = $1 AND customer_id = $2 AND (create_time, id) > ($3, $4)
		ORDER BY create_time, id LIMIT $5`, tenant, customerID, after.CreateTime, after.ID, limit+1)
	charges, err := pgx.CollectRows(rows, scanCharge)
	if err != nil || len(charges) <= limit {
		return charges, Position{}, ledgerError(err)
	}
	charges = charges[:limit]
	return charges, positionOf(charges[limit-1]), nil
}

const selectCharges = `SELECT id, customer_id, amount, currency, description, coalesce(merchant_reference, ''), create_time, processor_charge_id FROM charges`

func scanCharge(row pgx.CollectableRow) (*paymentsv1.Charge, error) {
	var (
		c       paymentsv1.Charge
		created time.Time
	)
	err := row.Scan(&c.Id, &c.CustomerId, &c.Amount, &c.Currency, &c.Description, &c.MerchantReference, &created, &c.ProcessorChargeId)
	c.CreateTime = timestamppb.New(created)
	return &c, err
}

// ledgerError answers a database call that had no effect with Unavailable,
// which the idemkey interceptor releases, so the client's retry runs the call
// again. The driver's message stays out of the reply.
func ledgerError(err error) error {
	if err == nil {
		return nil
	}
	return status.Error(codes.Unavailable, "the ledger is unavailable")
}

// DefaultPoolSize is the pool OpenDatabase opens for a URL without
// pool_max_conns. pgxpool's own default, max(4, cores), runs only three
// atomic handlers at once (store/postgres keeps a quarter of the pool for
// replays and records), and a fourth new key waits for one of them to end,
// at most the store's timeout: too few for a payment service whose handlers
// take seconds. Connections open only when used.
const DefaultPoolSize = 16

// OpenDatabase connects to url and creates or upgrades the ledger's table
// and, with idempotency, the idemkey store's: what the example's commands do
// at start. A URL without pool_max_conns gets DefaultPoolSize connections.
// configure, if given, adjusts the pool's configuration first.
func OpenDatabase(ctx context.Context, url string, idempotency bool, logger *slog.Logger, configure ...func(*pgxpool.Config)) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	if !strings.Contains(url, "pool_max_conns") {
		cfg.MaxConns = max(cfg.MaxConns, DefaultPoolSize)
	}
	for _, f := range configure {
		f(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if idempotency {
		if err := postgres.Migrate(ctx, pool, postgres.WithLogger(logger)); err != nil {
			pool.Close()
			return nil, err
		}
	}
	if err := MigrateLedger(ctx, pool); err != nil {
		pool.Close()
		return nil, fmt.Errorf("database: charges table: %w", err)
	}
	return pool, nil
}

// Background runs each of runs in a goroutine of its own until the
// returned stop is called, which cancels their context and waits for them
// to end: the example's commands run a store.Janitor this way, so that the
// table holds only the records still kept, and the server the store's
// Listen, so that a duplicate of a running call is answered at once. Their
// errors are dropped: each returns its context's error once stopped, and
// logs what fails before.
func Background(ctx context.Context, runs ...func(context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, run := range runs {
		wg.Go(func() { _ = run(ctx) })
	}
	return func() { cancel(); wg.Wait() }
}
