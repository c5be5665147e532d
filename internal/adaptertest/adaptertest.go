// Package adaptertest runs one table of behaviour cases against every entry
// point's adapter (gRPC, Connect, HTTP) on every store, so that no adapter
// drifts from the others: the same first call, replay, reuse, missing and
// malformed keys, in-progress answer, recorded and released errors, tenant
// isolation, failed store and oversized reply.
//
// Each adapter's test package gives Run an Adapter: a server of its own
// transport in front of the suite's Service, and a client that makes one
// Request and reads back a Reply in the suite's neutral terms.
package adaptertest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/store"
)

// Behaviours of the Service's handler, which a Request names: part of the
// request, so a request with another behaviour is another request.
const (
	Succeed      = "succeed"       // a reply naming the run that made it
	FailRecorded = "fail-recorded" // a final error, which is recorded (gRPC FailedPrecondition, HTTP 404)
	FailReleased = "fail-released" // a transient error, which releases the key (gRPC Unavailable, HTTP 503)
	Block        = "block"         // waits for Service.Unblock, then succeeds
	Huge         = "huge"          // a reply larger than Config.MaxRecordSize
)

// Request is one call, in the suite's terms.
type Request struct {
	Tenant    string // the caller's tenant, sent as the transport's credentials
	Key       string // "" sends no key
	KeyTwice  bool   // send the key twice (two metadata values, two headers)
	Amount    int64  // what the request is about: another amount is another request
	Behaviour string // what the handler does; Succeed if empty
}

// Reply is what the caller saw.
type Reply struct {
	OK         bool          // the call succeeded
	Status     int           // the transport's status: the gRPC code, the HTTP status
	Reason     string        // the idemkey reason of an idemkey answer, else ""
	Body       string        // the reply: the charge's id on success, else the error's message
	Replayed   bool          // the reply was marked replayed
	RetryAfter time.Duration // the wait an in-progress answer asks for
}

// Service is the handler behind every adapter: it counts its runs, and
// blocks when asked to.
type Service struct {
	runs    atomic.Int64
	started chan struct{}
	gate    chan struct{}
	once    sync.Once
}

// NewService returns a Service with no runs.
func NewService() *Service {
	return &Service{started: make(chan struct{}, 16), gate: make(chan struct{})}
}

// Handle runs the handler for one request: it returns the reply's id and
// how the call ended. Adapters translate the Result into their transport.
func (s *Service) Handle(ctx context.Context, tenant string, amount int64, behaviour string) (id string, res Result) {
	n := s.runs.Add(1)
	id = fmt.Sprintf("ch_%s_%d_run%d", tenant, amount, n)
	switch behaviour {
	case FailRecorded:
		return id, Recorded
	case FailReleased:
		return id, Released
	case Block:
		s.started <- struct{}{}
		select {
		case <-s.gate:
		case <-ctx.Done():
			return id, Released
		}
	case Huge:
		return strings.Repeat("x", 64<<10), OK
	}
	return id, OK
}

// Unblock lets every blocked and later run of Block go on.
func (s *Service) Unblock() { s.once.Do(func() { close(s.gate) }) }

// Runs is how many times the handler ran.
func (s *Service) Runs() int64 { return s.runs.Load() }

// Result is how the Service's handler ended.
type Result int

const (
	OK       Result = iota // a reply
	Recorded               // a final error, to record and replay: its message is "declined <id>"
	Released               // a transient error, to release: its message is "try later <id>"
)

// Config is the server an Adapter starts for one case.
type Config struct {
	Store       store.Store
	Atomic      bool // the operation runs in atomic mode (the store implements store.Atomic)
	KeyRequired bool
	// MaxRecordSize is the engine's bound; the Huge reply is larger.
	MaxRecordSize int
	// Every case also runs with no wait for a key in progress
	// (WithInProgressWait(0)) and a discarding logger (WithLogger(nil)),
	// which each adapter sets in its own terms.
	Service *Service
}

// Adapter is one entry point under test.
type Adapter struct {
	Name string
	// Serve starts a server for cfg, stopped when t ends, and returns its
	// client. The server takes the tenant from the Request's credentials.
	Serve func(t *testing.T, cfg Config) func(ctx context.Context, r Request) Reply
	// Status is the transport status the adapter answers with for each
	// idemkey reason, and for a recorded Internal error ("internal").
	Status map[string]int
}

// Store is one store the suite runs on.
type Store struct {
	Name string
	// New returns an empty store for one case.
	New func(t *testing.T) store.Store
	// Down returns a store whose every operation fails as an unreachable
	// server's does.
	Down func(t *testing.T) store.Store
	// Atomic runs the cases a second time in atomic mode.
	Atomic bool
}

// Run runs every case against a on each store.
func Run(t *testing.T, a Adapter, stores ...Store) {
	for _, st := range stores {
		modes := []bool{false}
		if st.Atomic {
			modes = append(modes, true)
		}
		for _, atomicMode := range modes {
			name := st.Name
			if atomicMode {
				name += "/atomic"
			}
			t.Run(name, func(t *testing.T) {
				for _, tc := range cases {
					t.Run(tc.name, func(t *testing.T) {
						t.Parallel()
						svc := NewService()
						cfg := Config{
							Store:         st.New(t),
							Atomic:        atomicMode,
							KeyRequired:   tc.keyRequired,
							MaxRecordSize: 16 << 10,
							Service:       svc,
						}
						if tc.down {
							cfg.Store = st.Down(t)
						}
						if tc.refuses {
							if atomicMode {
								t.Skip("in atomic mode the record commits with the transaction, not through Complete")
							}
							cfg.Store = refusing{cfg.Store}
						}
						call := a.Serve(t, cfg)
						ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
						defer cancel()
						tc.run(t, &suite{t: t, a: a, svc: svc, call: call, ctx: ctx})
					})
				}
			})
		}
	}
}

// suite is what a case works with.
type suite struct {
	t    *testing.T
	a    Adapter
	svc  *Service
	call func(ctx context.Context, r Request) Reply
	ctx  context.Context
}

func (s *suite) do(r Request) Reply {
	s.t.Helper()
	if r.Tenant == "" {
		r.Tenant = "acme"
	}
	if r.Behaviour == "" {
		r.Behaviour = Succeed
	}
	return s.call(s.ctx, r)
}

// wantRuns checks how many times the handler ran.
func (s *suite) wantRuns(want int64) {
	s.t.Helper()
	if got := s.svc.Runs(); got != want {
		s.t.Fatalf("the handler ran %d times, want %d", got, want)
	}
}

// wantReason checks that r is idemkey's answer for reason.
func (s *suite) wantReason(r Reply, reason string) {
	s.t.Helper()
	if r.OK || r.Reason != reason || r.Status != s.a.Status[reason] {
		s.t.Fatalf("got %+v, want status %d with reason %s", r, s.a.Status[reason], reason)
	}
}

// wantSame checks that replay repeats first, marked replayed.
func (s *suite) wantSame(first, replay Reply) {
	s.t.Helper()
	if !replay.Replayed || replay.OK != first.OK || replay.Status != first.Status || replay.Body != first.Body {
		s.t.Fatalf("replay %+v, want the first reply %+v marked replayed", replay, first)
	}
}

type testCase struct {
	name        string
	keyRequired bool
	down        bool // the store is down
	// refuses: the store refuses every record (Complete answers
	// store.ErrFull), as a full Redis does; two-phase only.
	refuses bool
	run     func(t *testing.T, s *suite)
}

var cases = []testCase{
	{name: "first call runs the handler", run: func(t *testing.T, s *suite) {
		r := s.do(Request{Key: "k1", Amount: 100})
		if !r.OK || r.Replayed || r.Body != "ch_acme_100_run1" {
			t.Fatalf("got %+v, want the first run's reply, not marked replayed", r)
		}
		s.wantRuns(1)
	}},
	{name: "retry replays the first reply", run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100})
		for range 2 {
			s.wantSame(first, s.do(Request{Key: "k1", Amount: 100}))
		}
		s.wantRuns(1)
	}},
	{name: "key reused with another request", run: func(t *testing.T, s *suite) {
		s.do(Request{Key: "k1", Amount: 100})
		s.wantReason(s.do(Request{Key: "k1", Amount: 200}), idemkey.ReasonKeyReused)
		s.wantReason(s.do(Request{Key: "k1", Amount: 100, Behaviour: FailRecorded}), idemkey.ReasonKeyReused)
		s.wantRuns(1)
	}},
	{name: "no key runs unprotected", run: func(t *testing.T, s *suite) {
		a, b := s.do(Request{Amount: 100}), s.do(Request{Amount: 100})
		if !a.OK || !b.OK || a.Body == b.Body || b.Replayed {
			t.Fatalf("got %+v and %+v, want two runs", a, b)
		}
		s.wantRuns(2)
	}},
	{name: "no key refused when required", keyRequired: true, run: func(t *testing.T, s *suite) {
		s.wantReason(s.do(Request{Amount: 100}), idemkey.ReasonKeyMissing)
		s.wantRuns(0)
	}},
	{name: "malformed key refused", run: func(t *testing.T, s *suite) {
		s.wantReason(s.do(Request{Key: strings.Repeat("k", idemkey.MaxKeyLen+1), Amount: 100}), idemkey.ReasonKeyInvalid)
		s.wantReason(s.do(Request{Key: "k1", KeyTwice: true, Amount: 100}), idemkey.ReasonKeyInvalid)
		s.wantRuns(0)
	}},
	{name: "duplicate while the first runs", run: func(t *testing.T, s *suite) {
		done := make(chan Reply, 1)
		go func() { done <- s.do(Request{Key: "k1", Amount: 100, Behaviour: Block}) }()
		select {
		case <-s.svc.started:
		case <-s.ctx.Done():
			t.Fatal("the first call never reached the handler")
		}
		dup := s.do(Request{Key: "k1", Amount: 100, Behaviour: Block})
		s.wantReason(dup, idemkey.ReasonInProgress)
		if dup.RetryAfter <= 0 {
			t.Fatalf("in progress without a wait to retry after: %+v", dup)
		}
		s.svc.Unblock()
		first := <-done
		if !first.OK {
			t.Fatalf("first call: %+v", first)
		}
		s.wantSame(first, s.do(Request{Key: "k1", Amount: 100, Behaviour: Block}))
		s.wantRuns(1)
	}},
	{name: "recorded error replays", run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100, Behaviour: FailRecorded})
		if first.OK || first.Reason != "" || !strings.Contains(first.Body, "declined") {
			t.Fatalf("got %+v, want the handler's final error", first)
		}
		s.wantSame(first, s.do(Request{Key: "k1", Amount: 100, Behaviour: FailRecorded}))
		s.wantRuns(1)
	}},
	{name: "released error runs again", run: func(t *testing.T, s *suite) {
		a := s.do(Request{Key: "k1", Amount: 100, Behaviour: FailReleased})
		b := s.do(Request{Key: "k1", Amount: 100, Behaviour: FailReleased})
		if a.OK || b.OK || b.Replayed || a.Body == b.Body {
			t.Fatalf("got %+v and %+v, want two runs that failed", a, b)
		}
		s.wantRuns(2)
	}},
	{name: "tenants do not share keys", run: func(t *testing.T, s *suite) {
		a := s.do(Request{Tenant: "acme", Key: "k1", Amount: 100})
		b := s.do(Request{Tenant: "globex", Key: "k1", Amount: 100})
		if !a.OK || !b.OK || b.Replayed || a.Body == b.Body {
			t.Fatalf("got %+v and %+v, want a run for each tenant", a, b)
		}
		s.wantRuns(2)
	}},
	{name: "store down fails closed", down: true, run: func(t *testing.T, s *suite) {
		s.wantReason(s.do(Request{Key: "k1", Amount: 100}), idemkey.ReasonStoreUnavailable)
		s.wantRuns(0)
	}},
	{name: "no room for the record never runs twice", refuses: true, run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100})
		if first.OK || first.Status != s.a.Status["internal"] {
			t.Fatalf("got %+v, want the internal error that takes the reply's place", first)
		}
		// Nothing could be recorded, so the key stays in progress until its
		// lease ends: never released, since the handler has run.
		s.wantReason(s.do(Request{Key: "k1", Amount: 100}), idemkey.ReasonInProgress)
		s.wantRuns(1)
	}},
	{name: "reply too large records an error", run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100, Behaviour: Huge})
		if first.OK || first.Status != s.a.Status["internal"] {
			t.Fatalf("got %+v, want the internal error that takes the reply's place", first)
		}
		s.wantSame(first, s.do(Request{Key: "k1", Amount: 100, Behaviour: Huge}))
		s.wantRuns(1)
	}},
}

// refusing is a store with no room for any record: its Complete answers
// store.ErrFull, even for an outcome of store.SmallOutcome bytes.
type refusing struct{ store.Store }

func (refusing) Complete(context.Context, store.Key, store.Token, []byte) error {
	return store.ErrFull
}

// ErrDown is the error of a store that is down.
var ErrDown = errors.New("adaptertest: the store is down")
