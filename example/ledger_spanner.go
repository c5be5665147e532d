package example

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"cloud.google.com/go/spanner"
	database "cloud.google.com/go/spanner/admin/database/apiv1"
	"cloud.google.com/go/spanner/admin/database/apiv1/databasepb"
	"google.golang.org/api/iterator"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	idemspanner "github.com/idemkey/idemkey/store/spanner"
)

// spannerChargesDDL is the example's own table on Spanner, as chargesSchema
// is on PostgreSQL. The unique index is NULL_FILTERED, so that an empty
// reference, stored as NULL, is not compared.
var spannerChargesDDL = []string{
	`CREATE TABLE charges (
	tenant              STRING(MAX) NOT NULL,
	id                  STRING(MAX) NOT NULL,
	customer_id         STRING(MAX) NOT NULL,
	amount              INT64       NOT NULL,
	currency            STRING(MAX) NOT NULL,
	description         STRING(MAX) NOT NULL,
	merchant_reference  STRING(MAX),
	create_time         TIMESTAMP   NOT NULL,
	processor_charge_id STRING(MAX) NOT NULL,
) PRIMARY KEY (tenant, id)`,
	`CREATE UNIQUE NULL_FILTERED INDEX charges_merchant_reference_key ON charges (tenant, merchant_reference)`,
	`CREATE INDEX charges_customer_page_idx ON charges (tenant, customer_id, create_time, id)`,
}

// SpannerLedger is a Ledger on the table charges in the Spanner database
// that also holds the idempotency keys.
type SpannerLedger struct{ client *spanner.Client }

// OpenSpanner connects to database (projects/P/instances/I/databases/D;
// the Go client goes to SPANNER_EMULATOR_HOST when it is set), creates the
// charges table and, with idempotency, the idemkey store's tables, and
// returns the client and the ledger on it.
func OpenSpanner(ctx context.Context, db string, idempotency bool, logger *slog.Logger) (*spanner.Client, *SpannerLedger, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	admin, err := database.NewDatabaseAdminClient(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("spanner: %w", err)
	}
	defer admin.Close()
	if idempotency {
		if err := idemspanner.Migrate(ctx, admin, db, idemspanner.WithLogger(logger)); err != nil {
			return nil, nil, err
		}
	}
	ddl, err := admin.GetDatabaseDdl(ctx, &databasepb.GetDatabaseDdlRequest{Database: db})
	if err != nil {
		return nil, nil, fmt.Errorf("spanner: %w", err)
	}
	exists := false
	for _, st := range ddl.GetStatements() {
		exists = exists || strings.HasPrefix(st, "CREATE TABLE charges ")
	}
	if !exists {
		op, err := admin.UpdateDatabaseDdl(ctx, &databasepb.UpdateDatabaseDdlRequest{Database: db, Statements: spannerChargesDDL})
		if err == nil {
			err = op.Wait(ctx)
		}
		if err != nil {
			return nil, nil, fmt.Errorf("spanner: charges table: %w", err)
		}
	}
	client, err := spanner.NewClientWithConfig(context.WithoutCancel(ctx), db, spanner.ClientConfig{DisableNativeMetrics: true})
	if err != nil {
		return nil, nil, fmt.Errorf("spanner: %w", err)
	}
	return client, &SpannerLedger{client: client}, nil
}

// Insert implements Ledger: in the call's transaction in atomic mode
// (idemspanner.TxFromContext), which commits the charge with the recorded
// reply; else in one of its own.
func (l *SpannerLedger) Insert(ctx context.Context, tenant string, c *paymentsv1.Charge) error {
	if txn, atomic := idemspanner.TxFromContext(ctx); atomic {
		ctx, cancel := insertContext(ctx)
		defer cancel()
		return spannerInsertError(l.insert(ctx, txn, tenant, c), true)
	}
	ctx, cancel := insertContext(ctx)
	defer cancel()
	_, err := l.client.ReadWriteTransaction(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		return l.insert(ctx, txn, tenant, c)
	})
	return spannerInsertError(err, false)
}

// spannerWriter is a read-write transaction: the client's, or the call's
// statement-based one in atomic mode.
type spannerWriter interface {
	ReadRowUsingIndex(ctx context.Context, table, index string, key spanner.Key, columns []string) (*spanner.Row, error)
	BufferWrite(ms []*spanner.Mutation) error
}

// insert writes c in txn, unless the tenant has a charge of its
// merchant_reference: the read locks the reference, so the check holds at
// the commit.
func (l *SpannerLedger) insert(ctx context.Context, txn spannerWriter, tenant string, c *paymentsv1.Charge) error {
	var ref *string
	if r := c.GetMerchantReference(); r != "" {
		ref = &r
		_, err := txn.ReadRowUsingIndex(ctx, "charges", "charges_merchant_reference_key", spanner.Key{tenant, r}, []string{"id"})
		if err == nil {
			return errDuplicateReference
		}
		if spanner.ErrCode(err) != codes.NotFound {
			return err
		}
	}
	return txn.BufferWrite([]*spanner.Mutation{spanner.Insert("charges",
		[]string{"tenant", "id", "customer_id", "amount", "currency", "description", "merchant_reference", "create_time", "processor_charge_id"},
		[]any{tenant, c.GetId(), c.GetCustomerId(), c.GetAmount(), c.GetCurrency(), c.GetDescription(), ref, c.GetCreateTime().AsTime(), c.GetProcessorChargeId()})})
}

// spannerInsertError answers an insert's err: a duplicate reference as
// such; a deadline passed, with the charge's commit perhaps made, as
// unknown (recorded, so that a retry cannot charge again); any other as
// Unavailable, released for a retry. In atomic mode nothing of the call
// commits before its record, so a deadline there made no charge: it too is
// Unavailable, and the retry runs once more, rather than an Unknown
// recorded for a charge that cannot exist.
func spannerInsertError(err error, atomic bool) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, errDuplicateReference):
		return errDuplicateReference
	case spanner.ErrCode(err) == codes.DeadlineExceeded && !atomic:
		return status.Error(codes.Unknown, "the charge's outcome is unknown: look for it with ListCharges before charging again")
	}
	return ledgerError(err)
}

const selectSpannerCharges = `SELECT id, customer_id, amount, currency, description, COALESCE(merchant_reference, ''), create_time, processor_charge_id FROM charges`

// Get implements Ledger.
func (l *SpannerLedger) Get(ctx context.Context, tenant, id string) (*paymentsv1.Charge, error) {
	charges, err := l.query(ctx, spanner.Statement{SQL: selectSpannerCharges + ` WHERE tenant = @tenant AND id = @id`,
		Params: map[string]any{"tenant": tenant, "id": id}})
	if err != nil {
		return nil, err
	}
	if len(charges) == 0 {
		return nil, errNoSuchCharge
	}
	return charges[0], nil
}

// List implements Ledger. It reads one row past the page, to learn whether
// another page follows.
func (l *SpannerLedger) List(ctx context.Context, tenant, customerID string, after Position, limit int) ([]*paymentsv1.Charge, Position, error) {
	charges, err := l.query(ctx, spanner.Statement{SQL: selectSpannerCharges + ` WHERE tenant = @tenant AND customer_id = @customer
		AND (create_time > @after_time OR (create_time = @after_time AND id > @after_id))
		ORDER BY create_time, id LIMIT @limit`,
		Params: map[string]any{"tenant": tenant, "customer": customerID, "after_time": after.CreateTime, "after_id": after.ID, "limit": int64(limit + 1)}})
	if err != nil || len(charges) <= limit {
		return charges, Position{}, err
	}
	charges = charges[:limit]
	return charges, positionOf(charges[limit-1]), nil
}

// query reads the charges stmt selects, in a strong single-use read.
func (l *SpannerLedger) query(ctx context.Context, stmt spanner.Statement) ([]*paymentsv1.Charge, error) {
	var charges []*paymentsv1.Charge
	it := l.client.Single().Query(ctx, stmt)
	defer it.Stop()
	for {
		row, err := it.Next()
		if errors.Is(err, iterator.Done) {
			return charges, nil
		}
		if err != nil {
			return nil, ledgerError(err)
		}
		var (
			c       paymentsv1.Charge
			created time.Time
		)
		if err := row.Columns(&c.Id, &c.CustomerId, &c.Amount, &c.Currency, &c.Description, &c.MerchantReference, &created, &c.ProcessorChargeId); err != nil {
			return nil, ledgerError(err)
		}
		c.CreateTime = timestamppb.New(created)
		charges = append(charges, &c)
	}
}
