package postgres

import (
	"cmp"
	"context"
	"strings"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// batchHandler is a handler's Querier in a batch: the batch's connection,
// cut off once the handler's call has ended. Its first statement carries
// the batch's pending statements (the call's savepoint) ahead of it, in
// one pipeline.
type batchHandler struct {
	t     *batchTx
	ended atomic.Bool
}

// plain reports whether the handler's statement goes out as it is: nothing
// is pending, or the arguments start with one of pgx's options (a query
// mode, a rewriter), which pipelines do not take, so that the pending
// statements go first, on their own.
func (h *batchHandler) plain(ctx context.Context, args []any) (bool, error) {
	if len(h.t.pending) == 0 {
		return true, nil
	}
	if len(args) > 0 {
		switch args[0].(type) {
		case pgx.QueryExecMode, pgx.QueryRewriter:
			return true, h.flush(ctx)
		}
	}
	return false, nil
}

// flush sends the pending statements on their own.
func (h *batchHandler) flush(ctx context.Context) error {
	pending := h.take()
	_, err := h.t.conn.Exec(ctx, strings.Join(pending, "; "))
	h.putBack(err, pending)
	return err
}

// take takes the pending statements, to send them.
func (h *batchHandler) take() []string {
	pending := h.t.pending
	h.t.pending = nil
	return pending
}

// putBack puts the pending statements back when what carried them failed
// and the transaction is not aborted: nothing of it ran on the server (pgx
// could not encode an argument, say), since a statement that fails in a
// transaction aborts it.
func (h *batchHandler) putBack(err error, pending []string) {
	if err != nil && h.t.conn != nil && h.t.conn.Conn().PgConn().TxStatus() == 'T' {
		h.t.pending = append(pending, h.t.pending...)
	}
}

// pipeline returns a batch of the pending statements, which it takes.
func (h *batchHandler) pipeline() (*pgx.Batch, []string) {
	pending := h.take()
	b := &pgx.Batch{}
	for _, sql := range pending {
		b.Queue(sql)
	}
	return b, pending
}

// sendPending sends b, which starts with the pending statements, and reads
// their results.
func (h *batchHandler) sendPending(ctx context.Context, b *pgx.Batch, pending []string) (pgx.BatchResults, error) {
	br := h.t.conn.SendBatch(ctx, b)
	for range pending {
		if _, err := br.Exec(); err != nil {
			br.Close()
			h.putBack(err, pending)
			return nil, err
		}
	}
	return br, nil
}

func (h *batchHandler) noteCommit(tag pgconn.CommandTag) {
	if tag.String() == "COMMIT" && h.t.conn != nil && h.t.conn.Conn().PgConn().TxStatus() == 'I' {
		h.t.committed.Store(true)
	}
}

func (h *batchHandler) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if h.ended.Load() {
		return pgconn.CommandTag{}, errTxEnded
	}
	plain, err := h.plain(ctx, args)
	switch {
	case err != nil:
		return pgconn.CommandTag{}, err
	case plain:
		tag, err := h.t.conn.Exec(ctx, sql, args...)
		h.noteCommit(tag)
		return tag, err
	case len(args) == 0:
		// pgx sends a statement without arguments in the simple protocol,
		// which takes several in one string, and answers the last one's tag.
		pending := h.take()
		tag, err := h.t.conn.Exec(ctx, strings.Join(pending, "; ")+"; "+sql)
		h.putBack(err, pending)
		h.noteCommit(tag)
		return tag, err
	}
	b, pending := h.pipeline()
	b.Queue(sql, args...)
	br, err := h.sendPending(ctx, b, pending)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := br.Exec()
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	h.noteCommit(tag)
	return tag, err
}

func (h *batchHandler) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if h.ended.Load() {
		return nil, errTxEnded
	}
	plain, err := h.plain(ctx, args)
	switch {
	case err != nil:
		return nil, err
	case plain:
		return h.t.conn.Query(ctx, sql, args...)
	}
	b, pending := h.pipeline()
	b.Queue(sql, args...)
	br, err := h.sendPending(ctx, b, pending)
	if err != nil {
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		br.Close()
		return nil, err
	}
	return &batchRows{Rows: rows, br: br}, nil
}

// QueryRow sends its statement when the row is scanned, if statements are
// pending, so as to send them with it.
func (h *batchHandler) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if h.ended.Load() {
		return endedRow{}
	}
	if len(h.t.pending) == 0 {
		return h.t.conn.QueryRow(ctx, sql, args...)
	}
	return lazyRow{h: h, ctx: ctx, sql: sql, args: args}
}

func (h *batchHandler) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if h.ended.Load() {
		return endedBatch{}
	}
	if len(h.t.pending) == 0 {
		return h.t.conn.SendBatch(ctx, b)
	}
	nb, pending := h.pipeline()
	nb.QueuedQueries = append(nb.QueuedQueries, b.QueuedQueries...)
	br, err := h.sendPending(ctx, nb, pending)
	if err != nil {
		return failedBatch{err}
	}
	return br
}

func (h *batchHandler) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if h.ended.Load() {
		return 0, errTxEnded
	}
	if len(h.t.pending) > 0 {
		if err := h.flush(ctx); err != nil {
			return 0, err
		}
	}
	return h.t.conn.CopyFrom(ctx, table, columns, src)
}

// lazyRow is QueryRow's row while statements are pending: Scan runs the
// query, as a pgx row's Scan reads it.
type lazyRow struct {
	h    *batchHandler
	ctx  context.Context
	sql  string
	args []any
}

func (r lazyRow) Scan(dest ...any) error {
	rows, err := r.h.Query(r.ctx, r.sql, r.args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := rows.Scan(dest...); err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

// batchRows are the rows of a query sent after pending statements: closing
// them closes the pipeline too.
type batchRows struct {
	pgx.Rows
	br     pgx.BatchResults
	closed bool
	err    error
}

func (r *batchRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.Close()
	return false
}

func (r *batchRows) Close() {
	if r.closed {
		return
	}
	r.closed = true
	r.Rows.Close()
	r.err = r.br.Close()
}

func (r *batchRows) Err() error { return cmp.Or(r.Rows.Err(), r.err) }

type failedBatch struct{ err error }

func (b failedBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, b.err }
func (b failedBatch) Query() (pgx.Rows, error)         { return nil, b.err }
func (b failedBatch) QueryRow() pgx.Row                { return errRow(b) }
func (b failedBatch) Close() error                     { return b.err }
func (b failedBatch) Tx() pgx.Tx                       { return nil }

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
