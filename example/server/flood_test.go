package main

import (
	"context"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/tests/redistest"
)

// floodScale is the size of TestDuplicateFlood: IDEMKEY_FLOOD_DUPLICATES
// duplicates (1000 by default) of a call whose handler takes
// IDEMKEY_FLOOD_DELAY (6s, longer than the PostgreSQL store's timeout of
// 5s, which a duplicate queued for capacity would run into), and
// IDEMKEY_FLOOD_BYSTANDERS new keys of another tenant (4). RELIABILITY.md's
// table comes from a run with 1000, 8s and 4.
func floodScale(t *testing.T) (duplicates int, delay time.Duration, bystanders int) {
	duplicates, delay, bystanders = 1000, 6*time.Second, 4
	var err error
	if v := os.Getenv("IDEMKEY_FLOOD_DUPLICATES"); v != "" {
		duplicates, err = strconv.Atoi(v)
	}
	if v := os.Getenv("IDEMKEY_FLOOD_DELAY"); v != "" && err == nil {
		delay, err = time.ParseDuration(v)
	}
	if v := os.Getenv("IDEMKEY_FLOOD_BYSTANDERS"); v != "" && err == nil {
		bystanders, err = strconv.Atoi(v)
	}
	if err != nil {
		t.Fatal(err)
	}
	return duplicates, delay, bystanders
}

// A flood of duplicates of one running call, with no deadline, while
// another tenant sends new keys, on each store and mode of the example
// server with its default pool: every duplicate is answered Aborted
// (IDEMPOTENCY_KEY_IN_PROGRESS), or the replay once the first call has
// committed, never Unavailable; the key is charged once; and the other
// tenant's new keys all succeed. How long the other tenant's calls take,
// against the same calls without the flood, is logged, not asserted (a busy
// machine stretches both): RELIABILITY.md has the figures.
func TestDuplicateFlood(t *testing.T) {
	duplicates, delay, bystanders := floodScale(t)
	for _, mode := range []struct {
		name   string
		db     bool
		atomic bool
		redis  bool
	}{{"postgres/atomic", true, true, false}, {"postgres/2-phase", true, false, false}, {"memory", false, false, false}, {"redis", false, false, true}} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			args := []string{"-database-url=", "-handler-delay=" + delay.String()}
			schema := ""
			switch {
			case mode.db:
				schema = pgtest.Schema(t)
				args = []string{"-database-url=" + pgtest.SchemaURL(schema), "-handler-delay=" + delay.String(), "-atomic=" + strconv.FormatBool(mode.atomic)}
			case mode.redis:
				args = append(args, "-redis-url=redis://"+redistest.Start(t).Addr)
			}
			s := servertest.Start(t, servertest.Build(t), args...)
			control := newKeys(t, s, bystanders)

			key := idemkey.NewKey()
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_flood", Amount: 1, Currency: "EUR"}
			first := make(chan error, 1)
			var (
				firstID   string
				firstDone time.Time
			)
			go func() {
				c, _, err := create(s, key, req)
				firstID, firstDone = c.GetId(), time.Now()
				first <- err
			}()
			time.Sleep(delay / 10) // the first call is running before the flood

			var (
				wg       sync.WaitGroup
				mu       sync.Mutex
				answers  = map[string]int{}
				replayed []string
				took     []time.Duration
				ends     []time.Time // of the duplicates that replayed
			)
			for range duplicates {
				wg.Go(func() {
					start := time.Now()
					c, _, err := create(s, key, req)
					mu.Lock()
					defer mu.Unlock()
					took = append(took, time.Since(start))
					answers[status.Code(err).String()+" "+idemkey.Reason(err)]++
					switch {
					case err == nil:
						replayed = append(replayed, c.GetId())
						ends = append(ends, time.Now())
					case status.Code(err) != codes.Aborted || idemkey.Reason(err) != idemkey.ReasonInProgress:
						t.Errorf("duplicate: %v, want Aborted %s or the replay", err, idemkey.ReasonInProgress)
					}
				})
			}
			flooded := newKeys(t, s, bystanders)
			wg.Wait()
			if err := <-first; err != nil {
				t.Fatalf("the first call: %v", err)
			}
			for _, id := range replayed {
				if id != firstID {
					t.Errorf("a duplicate replayed charge %s, want the first call's %s", id, firstID)
				}
			}
			if mode.db {
				var charges int
				if err := pgtest.Pool(t, schema).QueryRow(context.Background(),
					`SELECT count(*) FROM charges WHERE customer_id = 'cus_flood'`).Scan(&charges); err != nil || charges != 1 {
					t.Errorf("%d charges for the flooded key (%v), want 1", charges, err)
				}
			}
			slices.Sort(took)
			t.Logf("%s: %d duplicates: %v; answered in %v (median), %v (slowest)", mode.name, duplicates, answers, took[len(took)/2], took[len(took)-1])
			if len(ends) > 0 {
				after := make([]time.Duration, len(ends))
				for i, end := range ends {
					after[i] = end.Sub(firstDone)
				}
				slices.Sort(after)
				t.Logf("%s: %d replays, answered after the first call's reply: %v (median), %v (slowest)", mode.name, len(after), after[len(after)/2], after[len(after)-1])
			}
			t.Logf("%s: %d new keys of another tenant: %v without the flood, %v during it (%.2fx)",
				mode.name, bystanders, control, flooded, flooded.Seconds()/control.Seconds())
		})
	}
}

// newKeys sends n calls with new keys as tenant globex, at once, and returns
// how long the slowest took; each must succeed.
func newKeys(t *testing.T, s *servertest.Server, n int) time.Duration {
	t.Helper()
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		slowest time.Duration
	)
	for i := range n {
		wg.Go(func() {
			start := time.Now()
			_, _, err := createAs(s, "sk_test_globex", idemkey.NewKey(),
				&paymentsv1.CreateChargeRequest{CustomerId: "cus_bystander", Amount: int64(i + 1), Currency: "EUR"})
			if err != nil {
				t.Errorf("another tenant's new key: %v", err)
			}
			mu.Lock()
			slowest = max(slowest, time.Since(start))
			mu.Unlock()
		})
	}
	wg.Wait()
	return slowest
}
