package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// stats is the stats command's result.
type stats struct {
	Table          string `json:"table"`
	Completed      int64  `json:"completed"`
	InProgress     int64  `json:"in_progress"`
	InProgressLive int64  `json:"in_progress_live"` // of InProgress, under a lease that has not ended
	Expired        int64  `json:"expired_unswept"`  // counted as absent, waiting for a sweep
	// OldestLiveInProgress is the age of the oldest record in progress under
	// a live lease, in seconds: a call that has run this long. Nil if none.
	OldestLiveInProgress *float64 `json:"oldest_live_in_progress_seconds"`
	// The sizes are PostgreSQL's: null, and no indexes, on Spanner, which
	// tells them in its console.
	TotalBytes *int64  `json:"total_bytes"` // table, indexes and TOAST
	TableBytes *int64  `json:"table_bytes"`
	Indexes    []index `json:"indexes"`

	oldestLive, now time.Time // the database's, for OldestLiveInProgress
}

type index struct {
	Name  string `json:"name"`
	Bytes int64  `json:"bytes"`
}

func statsCommand() command {
	return command{
		exec: func(ctx context.Context, e *env) (any, error) {
			if err := e.checkTable(ctx); err != nil {
				return nil, err
			}
			s := &stats{Table: e.table, Indexes: []index{}}
			if err := e.db.stats(ctx, s); err != nil {
				return nil, err
			}
			if !s.oldestLive.IsZero() {
				age := s.now.Sub(s.oldestLive).Seconds()
				s.OldestLiveInProgress = &age
			}
			return s, nil
		},
		human: func(w io.Writer, result any) {
			s := result.(*stats)
			tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
			defer tw.Flush()
			fmt.Fprintf(tw, "table\t%s\n", s.Table)
			fmt.Fprintf(tw, "completed\t%d\n", s.Completed)
			fmt.Fprintf(tw, "in progress\t%d (%d under a live lease)\n", s.InProgress, s.InProgressLive)
			if s.TotalBytes == nil {
				fmt.Fprintf(tw, "expired, not yet deleted\t%d (by the row deletion policy)\n", s.Expired)
			} else {
				fmt.Fprintf(tw, "expired, not swept\t%d\n", s.Expired)
			}
			if s.OldestLiveInProgress != nil {
				fmt.Fprintf(tw, "oldest live in progress\t%s old\n", (time.Duration(*s.OldestLiveInProgress * float64(time.Second))).Round(time.Second))
			} else {
				fmt.Fprintf(tw, "oldest live in progress\tnone\n")
			}
			if s.TotalBytes == nil {
				fmt.Fprintf(tw, "size\tnot told to a query on Spanner: see its console\n")
				return
			}
			fmt.Fprintf(tw, "size\t%s in all, %s of rows\n", size(*s.TotalBytes), size(*s.TableBytes))
			for _, i := range s.Indexes {
				fmt.Fprintf(tw, "index %s\t%s\n", i.Name, size(i.Bytes))
			}
		},
	}
}

func size(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// swept is the sweep command's result.
type swept struct {
	Deleted int `json:"deleted"`
	// Nothing is why a store has nothing to sweep (Spanner); empty on PostgreSQL.
	Nothing string `json:"nothing_to_sweep,omitempty"`
}

// spannerSweeps is why sweep has nothing to do on Spanner.
const spannerSweeps = "nothing to sweep on Spanner: the tables' row deletion policy deletes expired rows, and the store counts them absent until then"

func sweepCommand() command {
	var (
		batch int
		share = 1.0
	)
	return command{
		flags: func(fs *flag.FlagSet) {
			fs.IntVar(&batch, "batch", store.DefaultSweepBatch, "rows deleted per statement")
			fs.Func("share", "the most of the sweep's time its statements take, 0.01 to 1: it rests after each batch (default 1, no rest)", func(v string) error {
				f, err := strconv.ParseFloat(v, 64)
				if err != nil || !(f >= 0.01 && f <= 1) {
					return errors.New("want a number from 0.01 to 1")
				}
				share = f
				return nil
			})
		},
		exec: func(ctx context.Context, e *env) (any, error) {
			if e.store == nil {
				return &swept{Nothing: spannerSweeps}, nil
			}
			if err := e.checkTable(ctx); err != nil {
				return nil, err
			}
			pst, err := postgres.New(e.pool, postgres.WithTable(e.table), postgres.WithSweepShare(share))
			if err != nil {
				return nil, err
			}
			var st store.Sweeper = pst // a store with native expiry (store/redis) has nothing to sweep
			n, err := st.Sweep(ctx, batch)
			if err != nil {
				return nil, &cmdError{code: exitDatabase, kind: "database", message: fmt.Sprintf("sweep failed after deleting %d records: %v", n, err)}
			}
			return &swept{Deleted: n}, nil
		},
		human: func(w io.Writer, result any) {
			if s := result.(*swept); s.Nothing != "" {
				fmt.Fprintln(w, s.Nothing)
				return
			}
			fmt.Fprintf(w, "swept %d expired records and steps\n", result.(*swept).Deleted)
		},
	}
}
