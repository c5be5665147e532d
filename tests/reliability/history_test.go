package reliability_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
)

// op is one business operation: one tenant's charge under one key, sent as
// often as the clients like. Its id is the request's description, so a charge
// row and a reply name the operation they belong to.
type op struct {
	id, tenant, key string

	mu      sync.Mutex
	replies []reply
}

// reply is what one attempt of an op received.
type reply struct {
	start, end time.Time
	code       codes.Code
	reason     string // idemkey's ErrorInfo reason, if any
	message    string
	charge     *paymentsv1.Charge // on OK
}

// final reports whether r ends the op: OK, or an error idemkey records and
// replays. Anything else (Aborted, Unavailable, a deadline) asks for a retry.
func (r reply) final() bool {
	switch r.code {
	case codes.OK, codes.Unknown, codes.AlreadyExists, codes.FailedPrecondition, codes.NotFound, codes.Internal, codes.DataLoss, codes.OutOfRange, codes.Unimplemented:
		return true
	}
	return false
}

func (o *op) request() *paymentsv1.CreateChargeRequest {
	return &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR", Description: o.id}
}

func (o *op) record(start time.Time, charge *paymentsv1.Charge, err error) reply {
	st := status.Convert(err)
	r := reply{start: start, end: time.Now(), code: st.Code(), reason: idemkey.Reason(err), message: st.Message(), charge: charge}
	o.mu.Lock()
	o.replies = append(o.replies, r)
	o.mu.Unlock()
	return r
}

// attempts is how many replies o has had.
func (o *op) attempts() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.replies)
}

func (o *op) done() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.ContainsFunc(o.replies, reply.final)
}

// history is every op of one run, and what the database held at its end.
type history struct {
	mu   sync.Mutex
	ops  []*op
	keys map[string]bool // tenant and key of every op

	charges map[string][]charge // by op id
	ids     map[string]charge   // by charge id
	// Idempotency records left in progress: under a live lease (stuck, as
	// no retry could take them over), or under one that has ended, which the
	// next retry of the key takes over.
	stuck, abandoned int
}

type charge struct {
	id, tenant, description string
	created                 time.Time
}

// add adds o, unless its tenant already uses its key for another op: that
// would be a reused key, which idemkey refuses.
func (h *history) add(o *op) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.keys == nil {
		h.keys = map[string]bool{}
	}
	if h.keys[o.tenant+"/"+o.key] {
		return false
	}
	h.keys[o.tenant+"/"+o.key] = true
	h.ops = append(h.ops, o)
	return true
}

// pick returns a random op that matches, or nil.
func (h *history) pick(n func(int) int, match func(*op) bool) *op {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.ops) == 0 {
		return nil
	}
	for range 8 {
		if o := h.ops[n(len(h.ops))]; match(o) {
			return o
		}
	}
	return nil
}

func (h *history) all() []*op {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.ops)
}

// load reads what the database holds: every charge, and the idempotency
// records still in progress.
func (h *history) load(ctx context.Context, c *cluster) error {
	rows, err := c.admin.Query(ctx, `SELECT id, tenant, description, create_time FROM charges`)
	if err != nil {
		return err
	}
	defer rows.Close()
	h.charges, h.ids = map[string][]charge{}, map[string]charge{}
	for rows.Next() {
		var ch charge
		if err := rows.Scan(&ch.id, &ch.tenant, &ch.description, &ch.created); err != nil {
			return err
		}
		h.charges[ch.description] = append(h.charges[ch.description], ch)
		h.ids[ch.id] = ch
	}
	if err := rows.Err(); err != nil {
		return err
	}
	// Only the records of this history's ops: another harness may share the
	// database (TestFailover runs both modes on one).
	var keys [][]byte
	for _, o := range h.all() {
		scope := store.ScopeKey(o.tenant, paymentsv1.PaymentService_CreateCharge_FullMethodName, o.key)
		keys = append(keys, scope[:])
	}
	return c.admin.QueryRow(ctx, `SELECT count(*) FILTER (WHERE lease_end > now()), count(*) FILTER (WHERE lease_end <= now())
		FROM idempotency_keys WHERE state = 'in_progress' AND key = ANY($1)`, keys).Scan(&h.stuck, &h.abandoned)
}

// verdict is the checker's count of each kind of anomaly, and what the run
// injected.
type verdict struct {
	atomic bool
	faults []fault

	requests, ops     int
	duplicates        int // ops charged more than once
	outsideWindow     int // second charges sooner than a lease could end
	divergent         int // ops whose OK replies name different charges
	divergentLost     int // of those, ops whose first run's record was lost with no server killed
	unheld            int // ops with an OK reply naming a charge the database does not hold
	crossTenant       int // replies that are not the caller's own
	unfinished        int // ops with no final reply
	stuck             int // idempotency records in progress under a live lease once all have ended
	abandoned         int // records in progress whose lease ended (two-phase: a record that failed)
	failedClosed      int // calls idemkey refused with IDEMPOTENCY_STORE_UNAVAILABLE
	unguarded         int // calls in an outage that idemkey did not refuse
	deadlinesExceeded int // calls the client cut short
	problems          []string
}

// check holds the history against the promise: in atomic mode, no op is
// charged twice; in two-phase mode, only when a run's lease ended first (the
// second charge comes at least a lease after the first). Every OK reply of an
// op names the same charge, one of the caller's tenant made for that op, and
// no op is left unfinished or in progress.
func (h *history) check(v *verdict) {
	problem := func(format string, args ...any) {
		if len(v.problems) < 20 {
			v.problems = append(v.problems, fmt.Sprintf(format, args...))
		}
	}
	for _, o := range h.all() {
		v.ops++
		v.requests += len(o.replies)
		charges := h.charges[o.id]
		if len(charges) > 1 {
			v.duplicates++
			slices.SortFunc(charges, func(a, b charge) int { return a.created.Compare(b.created) })
			for i := 1; i < len(charges); i++ {
				if gap := charges[i].created.Sub(charges[i-1].created); v.atomic || gap < leaseFloor {
					v.outsideWindow++
					problem("op %s charged again %v after its first charge (atomic %v)", o.id, gap, v.atomic)
				}
			}
		}
		okCharges := map[string]bool{}
		final, unheld := false, false
		for _, r := range o.replies {
			final = final || r.final()
			if r.code == codes.DeadlineExceeded {
				v.deadlinesExceeded++
			}
			if r.reason == idemkey.ReasonStoreUnavailable {
				v.failedClosed++
			}
			if r.code != codes.OK {
				continue
			}
			okCharges[r.charge.GetId()] = true
			row, known := h.ids[r.charge.GetId()]
			if r.charge.GetDescription() != o.id || (known && (row.tenant != o.tenant || row.description != o.id)) {
				v.crossTenant++
				problem("op %s of %s got charge %s of %s for %s", o.id, o.tenant, r.charge.GetId(), row.tenant, r.charge.GetDescription())
			}
			unheld = unheld || !known
			if !known && v.atomic {
				problem("op %s got OK with charge %s, which the database does not hold", o.id, r.charge.GetId())
			}
		}
		if unheld {
			v.unheld++
		}
		if len(okCharges) > 1 {
			v.divergent++
			if len(charges) < 2 {
				problem("op %s got %d different charges but was charged %d times", o.id, len(okCharges), len(charges))
			} else if !v.killedWithin(charges[0].created, callTimeout+leaseGrace) {
				// Nothing but a dead process may lose a record whose
				// caller got its reply: a failed write is retried until
				// shortly before the lease ends.
				v.divergentLost++
				problem("op %s got divergent replies, and no server was killed within a lease of its first charge", o.id)
			}
		}
		if !final {
			v.unfinished++
			problem("op %s never got a final reply: %v", o.id, o.codes())
		}
	}
	v.stuck, v.abandoned = h.stuck, h.abandoned
	if v.atomic && v.divergent > 0 {
		problem("%d ops got divergent replies in atomic mode", v.divergent)
	}
	if v.stuck > 0 {
		problem("%d idempotency records in progress under a live lease after every lease has ended", v.stuck)
	}
	if v.atomic && v.abandoned > 0 {
		problem("%d idempotency records left in progress in atomic mode", v.abandoned)
	}
}

// killedWithin reports whether a server process was killed within d after t.
func (v *verdict) killedWithin(t time.Time, d time.Duration) bool {
	for _, f := range v.faults {
		if f.kind == killServer && !f.at.Before(t) && f.at.Sub(t) <= d {
			return true
		}
	}
	return false
}

func (o *op) codes() string {
	var b strings.Builder
	for _, r := range o.replies {
		fmt.Fprintf(&b, "%v ", r.code)
	}
	return b.String()
}
