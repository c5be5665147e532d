package postgres

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/idemkey/idemkey/store"
)

// The outbox (store.Outbox, package outbox) lives in the table
// "<table>_outbox" (migration 004). WriteMessages writes in the handler's
// transaction, and notifies the relays on the outbox's channel, which
// PostgreSQL delivers only if that transaction commits; the relay's
// statements run on the pool, one round trip each.

var _ store.Outbox = (*Store)(nil)

// outboxChannelSQL is the SQL expression of the outbox's notification
// channel, named by its table's OID as channelSQL names the records'.
func outboxChannelSQL(outbox string) string {
	return fmt.Sprintf(`'idemkey:' || '%s'::regclass::oid || ':outbox'`, outbox)
}

// writeMessagesSQL inserts the messages in their order, dropping one whose
// id the outbox has (a re-run's copy), and notifies the relays if it wrote
// any. Parameters: ids, partition keys, destinations, bodies.
func writeMessagesSQL(outbox string) string {
	return fmt.Sprintf(`
WITH ins AS (
	INSERT INTO %[1]s (id, partition_key, destination, body)
	SELECT m.id, m.partition_key, m.destination, m.body
	FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[]) WITH ORDINALITY AS m (id, partition_key, destination, body, n)
	ORDER BY m.n
	ON CONFLICT (id) DO NOTHING
	RETURNING 1
)
SELECT pg_notify(%[2]s, '') WHERE EXISTS (SELECT FROM ins)`, outbox, outboxChannelSQL(outbox))
}

// claimSQL leases up to $1 messages for $2 microseconds: the unsent ones
// whose time has come, in order, each the oldest unsent of its partition.
// SKIP LOCKED passes over those another relay is claiming.
func claimSQL(outbox string) string {
	return fmt.Sprintf(`
WITH next AS (
	SELECT o.id FROM %[1]s AS o
	WHERE o.sent_at IS NULL AND o.not_before <= now()
		AND NOT EXISTS (SELECT FROM %[1]s AS p WHERE p.partition_key = o.partition_key AND p.sent_at IS NULL AND p.seq < o.seq)
	ORDER BY o.seq
	LIMIT $1
	FOR UPDATE SKIP LOCKED
)
UPDATE %[1]s AS o SET not_before = now() + $2 * interval '1 microsecond', attempts = o.attempts + 1
FROM next WHERE o.id = next.id
RETURNING o.seq, o.id, o.partition_key, o.destination, o.body, o.created_at, o.attempts`, outbox)
}

const (
	markSentSQL      = `UPDATE %s SET sent_at = now() WHERE id = ANY($1) AND sent_at IS NULL`
	retryMessagesSQL = `UPDATE %s AS o SET not_before = now() + $3 * interval '1 microsecond'
	FROM unnest($1::text[], $2::int[]) AS c (id, attempts) WHERE o.id = c.id AND o.attempts = c.attempts AND o.sent_at IS NULL`
	sweepSentSQL = `DELETE FROM %[1]s WHERE id IN (
	SELECT id FROM %[1]s WHERE sent_at < now() - $1 * interval '1 microsecond' ORDER BY sent_at LIMIT $2)`
	pendingSQL = `SELECT (SELECT count(*) FROM %[1]s WHERE sent_at IS NULL),
	coalesce((SELECT extract(epoch FROM now() - created_at) FROM %[1]s WHERE sent_at IS NULL ORDER BY seq LIMIT 1), 0)::float8`
)

// WriteMessages implements store.Outbox through the Querier that ctx
// carries (TxFromContext): an atomic call's transaction, or a two-phase
// handler's own given with ContextWithTx. Package outbox's Publish calls it.
func (s *Store) WriteMessages(ctx context.Context, ms []store.OutboxMessage) error {
	q, ok := TxFromContext(ctx)
	if !ok || !inTransaction(q) {
		return errors.New("idemkey postgres: WriteMessages needs the handler's transaction in its context (an atomic call's, or a pgx.Tx given with postgres.ContextWithTx): " +
			"a message written outside it (through a pool or a connection) would be sent whether or not the handler's writes commit")
	}
	if len(ms) == 0 {
		return nil
	}
	ids, parts, dests, bodies := make([]string, len(ms)), make([]string, len(ms)), make([]string, len(ms)), make([][]byte, len(ms))
	for i, m := range ms {
		ids[i], parts[i], dests[i], bodies[i] = m.ID, m.PartitionKey, m.Destination, m.Body
	}
	if _, err := q.Exec(ctx, s.writeMessagesSQL, ids, parts, dests, bodies); err != nil {
		return s.translate(ctx, "write messages", err)
	}
	return nil
}

// inTransaction reports whether q writes in a transaction: an atomic
// call's or batch's, or a pgx.Tx (what has Commit and Rollback), not a
// pool or a connection that would commit each statement on its own.
func inTransaction(q Querier) bool {
	switch q.(type) {
	case *handlerTx, *batchHandler:
		return true
	case interface {
		Commit(context.Context) error
		Rollback(context.Context) error
	}:
		return true
	}
	return false
}

// ClaimMessages implements store.Outbox.
func (s *Store) ClaimMessages(ctx context.Context, max int, lease time.Duration) ([]store.OutboxMessage, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	rows, err := s.pool.Query(ctx, s.claimSQL, max, lease.Microseconds())
	if err != nil {
		return nil, s.translate(ctx, "claim messages", err)
	}
	type claimed struct {
		seq int64
		m   store.OutboxMessage
	}
	var cs []claimed
	for rows.Next() {
		var c claimed
		if err := rows.Scan(&c.seq, &c.m.ID, &c.m.PartitionKey, &c.m.Destination, &c.m.Body, &c.m.Created, &c.m.Attempts); err != nil {
			rows.Close()
			return nil, s.translate(ctx, "claim messages", err)
		}
		cs = append(cs, c)
	}
	if err := rows.Err(); err != nil {
		return nil, s.translate(ctx, "claim messages", err)
	}
	slices.SortFunc(cs, func(a, b claimed) int { return cmp.Compare(a.seq, b.seq) })
	ms := make([]store.OutboxMessage, len(cs))
	for i, c := range cs {
		ms[i] = c.m
	}
	return ms, nil
}

// MarkSent implements store.Outbox.
func (s *Store) MarkSent(ctx context.Context, ids []string) error {
	return s.execOutbox(ctx, "mark messages sent", s.markSentSQL, ids)
}

// RetryMessages implements store.Outbox.
func (s *Store) RetryMessages(ctx context.Context, ms []store.OutboxMessage, delay time.Duration) error {
	ids, attempts := make([]string, len(ms)), make([]int32, len(ms))
	for i, m := range ms {
		ids[i], attempts[i] = m.ID, int32(m.Attempts)
	}
	return s.execOutbox(ctx, "retry messages", s.retryMessagesSQL, ids, attempts, max(delay, 0).Microseconds())
}

func (s *Store) execOutbox(ctx context.Context, op, sql string, args ...any) error {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if _, err := s.pool.Exec(ctx, sql, args...); err != nil {
		return s.translate(ctx, op, err)
	}
	return nil
}

// SweepSent implements store.Outbox.
func (s *Store) SweepSent(ctx context.Context, retention time.Duration, limit int) (int64, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	tag, err := s.pool.Exec(ctx, s.sweepSentSQL, max(retention, 0).Microseconds(), limit)
	if err != nil {
		return 0, s.translate(ctx, "sweep sent messages", err)
	}
	return tag.RowsAffected(), nil
}

// PendingMessages implements store.Outbox.
func (s *Store) PendingMessages(ctx context.Context) (n int64, oldest time.Duration, err error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var seconds float64
	if err := s.pool.QueryRow(ctx, s.pendingSQL).Scan(&n, &seconds); err != nil {
		return 0, 0, s.translate(ctx, "count pending messages", err)
	}
	return n, time.Duration(seconds * float64(time.Second)), nil
}

// ListenMessages implements store.Outbox on a connection it takes out of
// the pool for good, as Listen does.
func (s *Store) ListenMessages(ctx context.Context, wake func()) error {
	err := s.listenMessages(ctx, wake)
	if ctx.Err() != nil {
		return nil
	}
	return s.translate(ctx, "listen for messages", err)
}

func (s *Store) listenMessages(ctx context.Context, wake func()) error {
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	conn := pc.Hijack()
	defer conn.Close(context.WithoutCancel(ctx))
	var channel string
	if err := conn.QueryRow(ctx, `SELECT `+outboxChannelSQL(s.outbox)).Scan(&channel); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, `LISTEN "`+channel+`"`); err != nil {
		return err
	}
	wake() // a message committed before LISTEN told no one
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		wake()
	}
}
