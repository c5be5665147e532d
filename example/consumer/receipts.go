package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/store/postgres"
)

// receiptsSchema is -receipts' table: one row a charge. Its unique
// constraint on the charge is the second line of defence, behind idemkey's
// drop of a message's redelivery; but it does not hide what it catches: a
// second receipt of a charge counts in the first's duplicates, in the same
// transaction, so that a double that idemkey let through is seen.
const receiptsSchema = `
CREATE TABLE IF NOT EXISTS receipts (
	seq         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	tenant      text        NOT NULL,
	charge_id   text        NOT NULL,
	amount      bigint      NOT NULL,
	currency    text        NOT NULL,
	create_time timestamptz NOT NULL DEFAULT now(),
	duplicates  integer     NOT NULL DEFAULT 0,
	CONSTRAINT receipts_charge_key UNIQUE (tenant, charge_id)
)`

// receipts writes a receipt of each charge announced.
type receipts struct {
	pool *pgxpool.Pool // two-phase mode's; atomic mode writes in the message's transaction
}

// newReceipts creates the receipts table, unless it exists.
func newReceipts(ctx context.Context, pool *pgxpool.Pool) (*receipts, error) {
	_, err := pool.Exec(ctx, receiptsSchema)
	var pgErr *pgconn.PgError
	// Consumers starting at once collide in the catalog; the loser finds
	// the table.
	if err != nil && !(errors.As(err, &pgErr) && (pgErr.Code == "23505" || pgErr.Code == "42P07")) {
		return nil, fmt.Errorf("database: receipts table: %w", err)
	}
	return &receipts{pool: pool}, nil
}

// write writes the receipt of the charge body announces, for tenant: in
// atomic mode in the transaction that commits the message's record.
func (r *receipts) write(ctx context.Context, tenant string, body []byte) error {
	var c example.ChargeCreated
	if err := json.Unmarshal(body, &c); err != nil || c.ID == "" {
		return consumer.Final(status.Error(codes.InvalidArgument, "the body is not a ChargeCreated in JSON"))
	}
	if c.Tenant != tenant {
		return consumer.Final(status.Error(codes.InvalidArgument, "the body's tenant is not the message's"))
	}
	var db postgres.Querier = r.pool
	if tx, ok := postgres.TxFromContext(ctx); ok {
		db = tx
	}
	_, err := db.Exec(ctx, `INSERT INTO receipts (tenant, charge_id, amount, currency) VALUES ($1, $2, $3, $4)
		ON CONFLICT ON CONSTRAINT receipts_charge_key DO UPDATE SET duplicates = receipts.duplicates + 1`,
		c.Tenant, c.ID, c.Amount, c.Currency)
	if err != nil {
		// For now: the message is redelivered. The driver's words stay out
		// of the log, which they may quote a row in.
		return status.Error(codes.Unavailable, "the receipts' database is unavailable")
	}
	return nil
}

// receiptDefaults sets -receipts' defaults of the flags not set.
func receiptDefaults(cfg *config, set map[string]bool) {
	for name, v := range map[string]*string{"subject": &cfg.subject, "queue": &cfg.queue, "topic": &cfg.topic} {
		if !set[name] {
			*v = example.ChargeCreatedDestination
		}
	}
	if !set["name"] {
		cfg.name = "receipts"
	}
	if !set["stream"] {
		cfg.stream = "" // the stream of the subject
	}
}

// streamName is the name of the stream this command (or the server's
// relay) makes for subject, if none takes it.
func streamName(subject string) string {
	return strings.ToUpper(strings.NewReplacer(".", "_", "*", "_", ">", "_").Replace(subject))
}
