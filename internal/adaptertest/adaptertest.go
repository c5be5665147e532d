// Package adaptertest runs one table of behaviour cases against every entry
// point's adapter (gRPC, Connect, HTTP) on every store, so that no adapter
// drifts from the others: the same first call, replay, reuse, missing and
// malformed keys, in-progress answer, recorded and released errors, tenant
// isolation, failed store (closed and open) and oversized reply; each
// answer's fate marker, and a key sent to an operation not covered; sealed records, rotated
// keys and a record that does not open; redacted replies; and the same
// hooks for each (engine.WithHooks), which every case checks, one per call.
//
// Each adapter's test package gives Run an Adapter: a server of its own
// transport in front of the suite's Service, and a client that makes one
// Request and reads back a Reply in the suite's neutral terms.
package adaptertest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/sealtest"
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
	// Steps (engine.Step): each charges once in its step "charge" (Charges
	// counts it), then, on the Service's first run of it, fails released.
	StepThenFail = "step-then-fail" // the step returns; a retry gets its result
	StepLost     = "step-lost"      // the step's answer is lost, and nothing reconciles it
	StepFound    = "step-found"     // the step's answer is lost, and its reconcile finds the charge
)

// Request is one call, in the suite's terms.
type Request struct {
	Tenant    string // the caller's tenant, sent as the transport's credentials
	Key       string // "" sends no key
	KeyTwice  bool   // send the key twice (two metadata values, two headers)
	Amount    int64  // what the request is about: another amount is another request
	Behaviour string // what the handler does; Succeed if empty
	// FirstSent is sent as the transport's first-sent field
	// (idemkey.FirstSentMetadata, idemkey.FirstSentHeader), if not "".
	FirstSent string
	// FirstRegion is sent as the transport's first-region field
	// (idemkey.FirstRegionMetadata, idemkey.FirstRegionHeader), if not "".
	FirstRegion string
	// Uncovered calls an operation the entry point does not cover (gRPC and
	// Connect: GetCharge, NO_SIDE_EFFECTS; HTTP: a GET), whose handler is
	// the Service's too, with the Behaviour and no amount.
	Uncovered bool
}

// Reply is what the caller saw.
type Reply struct {
	OK         bool          // the call succeeded
	Status     int           // the transport's status: the gRPC code, the HTTP status
	Reason     string        // the idemkey reason of an idemkey answer, else ""
	Body       string        // the reply: the charge's id on success, else the error's message
	Replayed   bool          // the reply was marked replayed (idemkey.ParseReplayed)
	Executed   bool          // marked the key's first execution (idemkey.ParseExecuted)
	Ignored    bool          // marked not honoured (idemkey.ParseIgnored)
	RetryAfter time.Duration // the wait an in-progress answer asks for
	// Expires is the key's expiry the answer told (idemkey.ExpiresMetadata
	// in the header or trailer, idemkey.ExpiresHeader), or "".
	Expires string
}

// Service is the handler behind every adapter: it counts its runs, and
// blocks when asked to.
type Service struct {
	runs    atomic.Int64
	charges atomic.Int64
	failed  sync.Map // the step behaviours that failed once
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
	case StepThenFail, StepLost, StepFound:
		return s.charge(ctx, id, behaviour)
	}
	return id, OK
}

// charge runs a step behaviour's step, then fails released on its first run.
func (s *Service) charge(ctx context.Context, id, behaviour string) (string, Result) {
	var reconcile func(context.Context) (string, bool, error)
	if behaviour == StepFound {
		reconcile = func(context.Context) (string, bool, error) { return "charged", true, nil }
	}
	charged, err := engine.Step(ctx, "charge", func(context.Context) (string, error) {
		s.charges.Add(1)
		if behaviour != StepThenFail {
			return "", errors.New("the processor's answer was lost")
		}
		return "charged", nil
	}, reconcile)
	if _, again := s.failed.LoadOrStore(behaviour, true); !again || err != nil {
		return id, Released
	}
	return id + "_" + charged, OK
}

// Charges is how many times a step behaviour's step ran.
func (s *Service) Charges() int64 { return s.charges.Load() }

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
	// Hooks are the application's hooks (engine.WithHooks).
	Hooks engine.Hooks
	// Every case also runs with no wait for a key in progress
	// (WithInProgressWait(0)) and a discarding logger (WithLogger(nil)):
	// see Engine.
	Service *Service
	// Sealer, if not nil, seals the records (engine.WithSealer).
	Sealer engine.Sealer
	// Redact, if true, records each reply with Redact applied to the run's
	// id in it (the adapter's WithRedaction): in a response, in an error's
	// message, in a header the adapter replays.
	Redact bool
	// FailOpen runs the handler unprotected when the store fails
	// (engine.WithFailOpen).
	FailOpen bool
	// Region, if not "", is the region the engine serves (engine.WithRegion).
	Region string
}

// Engine is the engine of cfg, whose tenants tenant reads from the
// adapter's transport.
func (cfg Config) Engine(t *testing.T, tenant engine.TenantFunc) *engine.Engine {
	t.Helper()
	opts := []engine.Option{engine.WithTenant(tenant), engine.WithMaxRecordSize(cfg.MaxRecordSize),
		engine.WithInProgressWait(0), engine.WithLogger(nil), engine.WithHooks(cfg.Hooks), engine.WithSealer(cfg.Sealer)}
	if cfg.KeyRequired {
		opts = append(opts, engine.WithKeyRequired())
	}
	if cfg.FailOpen {
		opts = append(opts, engine.WithFailOpen())
	}
	if cfg.Region != "" {
		opts = append(opts, engine.WithRegion(cfg.Region))
	}
	eng, err := engine.New(cfg.Store, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return eng
}

// Redacted replaces the run's id in what is recorded of a reply when
// Config.Redact is set.
const Redacted = "redacted"

var runID = regexp.MustCompile(`ch_[a-z]+_[0-9]+_run[0-9]+`)

// Redact is s with every run id ("ch_acme_100_run1") replaced by Redacted:
// what an adapter's redaction function does to each part of a reply.
func Redact(s string) string { return runID.ReplaceAllString(s, Redacted) }

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
						hooks := &hookRecorder{}
						cfg := Config{
							Store:         st.New(t),
							Atomic:        atomicMode,
							KeyRequired:   tc.keyRequired,
							MaxRecordSize: 16 << 10,
							Hooks:         hooks.hooks(),
							Service:       svc,
							Redact:        tc.redact,
						}
						if tc.sealed {
							cfg.Sealer = sealtest.Ring(t, 1)
						}
						if tc.tampered {
							cfg.Store = Tampering(cfg.Store)
						}
						if tc.down || tc.failOpen {
							cfg.Store, cfg.FailOpen = st.Down(t), tc.failOpen
						}
						if tc.failOpen && atomicMode {
							t.Skip("atomic mode fails closed, even with WithFailOpen")
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
						s := &suite{t: t, a: a, svc: svc, call: call, ctx: ctx, cfg: cfg, hooks: hooks}
						tc.run(t, s)
						s.wantHooks(tc.hooks...)
					})
				}
			})
		}
	}
}

// suite is what a case works with.
type suite struct {
	t     *testing.T
	a     Adapter
	svc   *Service
	call  func(ctx context.Context, r Request) Reply
	ctx   context.Context
	cfg   Config
	hooks *hookRecorder
}

func (s *suite) do(r Request) Reply {
	s.t.Helper()
	return s.doWith(s.call, r)
}

// serve starts another server of the adapter on the case's store and
// Service, with cfg changed by change: another replica.
func (s *suite) serve(change func(*Config)) func(ctx context.Context, r Request) Reply {
	s.t.Helper()
	cfg := s.cfg
	change(&cfg)
	return s.a.Serve(s.t, cfg)
}

// doWith makes r through the client call.
func (s *suite) doWith(call func(ctx context.Context, r Request) Reply, r Request) Reply {
	s.t.Helper()
	if r.Tenant == "" {
		r.Tenant = "acme"
	}
	if r.Behaviour == "" {
		r.Behaviour = Succeed
	}
	reply := call(s.ctx, r)
	if !r.Uncovered { // which the engine never sees
		s.hooks.answered(r, reply)
	}
	return reply
}

// wantRuns checks how many times the handler ran.
func (s *suite) wantRuns(want int64) {
	s.t.Helper()
	if got := s.svc.Runs(); got != want {
		s.t.Fatalf("the handler ran %d times, want %d", got, want)
	}
}

// wantReason checks that r is idemkey's answer for reason.
func (s *suite) wantCharges(want int64) {
	s.t.Helper()
	if got := s.svc.Charges(); got != want {
		s.t.Errorf("the steps charged %d times, want %d", got, want)
	}
}

func (s *suite) wantReason(r Reply, reason string) {
	s.t.Helper()
	if r.OK || r.Reason != reason || r.Status != s.a.Status[reason] {
		s.t.Fatalf("got %+v, want status %d with reason %s", r, s.a.Status[reason], reason)
	}
}

// wantSame checks that replay repeats first, marked replayed.
func (s *suite) wantSame(first, replay Reply) {
	s.t.Helper()
	if s.fate(replay) != "replayed" || replay.OK != first.OK || replay.Status != first.Status || replay.Body != first.Body {
		s.t.Fatalf("replay %+v, want the first reply %+v marked replayed", replay, first)
	}
}

// fate is the one fate r is marked with: "executed", "replayed", "ignored",
// or "" for none.
func (s *suite) fate(r Reply) string {
	s.t.Helper()
	var fates []string
	for _, f := range []struct {
		marked bool
		name   string
	}{{r.Executed, "executed"}, {r.Replayed, "replayed"}, {r.Ignored, "ignored"}} {
		if f.marked {
			fates = append(fates, f.name)
		}
	}
	if len(fates) > 1 {
		s.t.Fatalf("got %+v, marked with %d fates, want one at most", r, len(fates))
	}
	return strings.Join(fates, "")
}

// wantFate checks r's fate marker.
func (s *suite) wantFate(r Reply, fate string) {
	s.t.Helper()
	if got := s.fate(r); got != fate {
		s.t.Fatalf("got %+v, marked %q, want %q", r, got, fate)
	}
}

type testCase struct {
	name        string
	keyRequired bool
	down        bool // the store is down
	// refuses: the store refuses every record (Complete answers
	// store.ErrFull), as a full Redis does; two-phase only.
	refuses  bool
	failOpen bool // the store is down and the engine fails open; two-phase only
	sealed   bool // the records are sealed (sealtest.Ring(t, 1))
	// tampered: the store alters every completed record it reads back
	// (Tampering).
	tampered bool
	redact   bool // Config.Redact
	run      func(t *testing.T, s *suite)
	// hooks are the hooks the case's calls ran, in order, as "hook
	// verdict": "execute executed", "replay replayed", "refuse reused".
	hooks []string
}

// wantExpires checks that r tells its key's expiry, as an HTTP date about
// the engine's default retention from now, and returns it.
func (s *suite) wantExpires(r Reply) time.Time {
	s.t.Helper()
	exp, err := idemkey.ParseDate(r.Expires)
	if err != nil {
		s.t.Fatalf("got %+v, want the key's expiry as an HTTP date", r)
	}
	if d := time.Until(exp); d < engine.DefaultRetention-time.Minute || d > engine.DefaultRetention {
		s.t.Fatalf("expiry %s is %v from now, want about %v", r.Expires, d, engine.DefaultRetention)
	}
	return exp
}

var cases = []testCase{
	{name: "a step's result is kept for the retry of a released failure", run: func(t *testing.T, s *suite) {
		r := Request{Key: "k1", Amount: 100, Behaviour: StepThenFail}
		if first := s.do(r); first.OK {
			t.Fatalf("got %+v, want the released failure", first)
		}
		if again := s.do(r); !again.OK || !strings.HasSuffix(again.Body, "_charged") {
			t.Fatalf("got %+v, want the retry to complete with the step's result", again)
		}
		s.wantCharges(1)
		s.wantRuns(2)
	}, hooks: []string{"execute executed unrecorded", "execute executed"}},
	{name: "a step an earlier run left started is never run blind", run: func(t *testing.T, s *suite) {
		r := Request{Key: "k1", Amount: 100, Behaviour: StepLost}
		if first := s.do(r); first.OK {
			t.Fatalf("got %+v, want the released failure", first)
		}
		for range 2 {
			s.wantReason(s.do(r), idemkey.ReasonOutcomeUnknown)
		}
		s.wantCharges(1)
		s.wantRuns(3)
		// Another key is another charge.
		if other := s.do(Request{Key: "k2", Amount: 100, Behaviour: StepThenFail}); other.OK {
			t.Fatalf("got %+v, want the released failure", other)
		}
		s.wantCharges(2)
	}, hooks: []string{"execute executed unrecorded", "refuse outcome_unknown", "refuse outcome_unknown", "execute executed unrecorded"}},
	{name: "a step an earlier run left started is reconciled", run: func(t *testing.T, s *suite) {
		r := Request{Key: "k1", Amount: 100, Behaviour: StepFound}
		if first := s.do(r); first.OK {
			t.Fatalf("got %+v, want the released failure", first)
		}
		again := s.do(r)
		if !again.OK || !strings.HasSuffix(again.Body, "_charged") {
			t.Fatalf("got %+v, want the retry to complete with the reconciled result", again)
		}
		s.wantSame(again, s.do(r))
		s.wantCharges(1)
	}, hooks: []string{"execute executed unrecorded", "execute executed", "replay replayed"}},
	{name: "every answer about a key tells its expiry", run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100})
		s.wantExpires(first)
		for _, r := range []Reply{s.do(Request{Key: "k1", Amount: 100}), s.do(Request{Key: "k1", Amount: 200})} {
			if r.Expires != first.Expires {
				t.Errorf("got %+v, want the first reply's expiry %s", r, first.Expires)
			}
		}
		recorded := s.do(Request{Key: "k2", Amount: 100, Behaviour: FailRecorded})
		s.wantExpires(recorded)
		// Without a record, nothing is honoured.
		for _, r := range []Reply{s.do(Request{Key: "k3", Amount: 100, Behaviour: FailReleased}), s.do(Request{Amount: 100})} {
			if r.Expires != "" {
				t.Errorf("got %+v, want no expiry: no record was made", r)
			}
		}
		s.wantRuns(4)
	}, hooks: []string{"execute executed", "replay replayed", "refuse reused", "execute executed", "execute executed unrecorded", "execute no_key"}},
	{name: "a retry first sent before the retention is refused", run: func(t *testing.T, s *suite) {
		oldAt := time.Now().Add(-engine.DefaultRetention - time.Minute).UTC()
		old := idemkey.FormatDate(oldAt)
		refused := s.do(Request{Key: "k1", Amount: 100, FirstSent: old})
		s.wantReason(refused, idemkey.ReasonKeyExpired)
		if refused.Expires != "" {
			t.Errorf("got %+v, want no expiry for a key that has no record", refused)
		}
		// The obsolete forms of an HTTP date, RFC 850 and asctime, which
		// RFC 9110 has a recipient accept, name the same time.
		for _, layout := range []string{"Monday, 02-Jan-06 15:04:05 GMT", "Mon Jan _2 15:04:05 2006"} {
			s.wantReason(s.do(Request{Key: "k1", Amount: 100, FirstSent: oldAt.Format(layout)}), idemkey.ReasonKeyExpired)
		}
		// The oldest date there is, the zero time.Time, is as stale.
		s.wantReason(s.do(Request{Key: "k1", Amount: 100, FirstSent: "Mon, 01 Jan 0001 00:00:00 GMT"}), idemkey.ReasonKeyExpired)
		// A value padded with spaces, which HTTP trims, is read
		// alike on every transport.
		s.wantReason(s.do(Request{Key: "k1", Amount: 100, FirstSent: "  " + old + " "}), idemkey.ReasonKeyExpired)
		s.wantRuns(0)
		// The refusal held the key for no one: a recent call runs, and a
		// stale retry of it, whose key now has a record, replays.
		first := s.do(Request{Key: "k1", Amount: 100, FirstSent: idemkey.FormatDate(time.Now())})
		if !first.OK {
			t.Fatalf("got %+v, want a run", first)
		}
		s.wantSame(first, s.do(Request{Key: "k1", Amount: 100, FirstSent: old}))
		s.wantRuns(1)
	}, hooks: []string{"refuse key_expired", "refuse key_expired", "refuse key_expired", "refuse key_expired", "refuse key_expired", "execute executed", "replay replayed"}},
	{name: "a malformed or future first-sent time is refused", run: func(t *testing.T, s *suite) {
		for _, v := range []string{"yesterday", idemkey.FormatDate(time.Now().Add(time.Hour)), "Tue, 01 Dec 2026 20:05:37 +0000"} {
			s.wantReason(s.do(Request{Key: "k1", Amount: 100, FirstSent: v}), idemkey.ReasonFirstSentInvalid)
		}
		s.wantRuns(0)
	}, hooks: []string{"refuse first_sent_invalid", "refuse first_sent_invalid", "refuse first_sent_invalid"}},
	{name: "a key first sent to another region runs only there", run: func(t *testing.T, s *suite) {
		// Two regions' servers on one store: what region b records is what
		// replication would bring to region a.
		a := s.serve(func(c *Config) { c.Region = "a" })
		b := s.serve(func(c *Config) { c.Region = "b" })
		r := Request{Key: "k1", Amount: 100, FirstRegion: "b"}
		for range 2 { // the client failed over to a before b's record arrived
			fenced := s.doWith(a, r)
			s.wantReason(fenced, idemkey.ReasonInProgress)
			if fenced.RetryAfter <= 0 || fenced.Expires != "" || s.fate(fenced) != "" {
				t.Fatalf("got %+v, want a retry delay, and neither expiry nor fate: the key has no record here", fenced)
			}
		}
		s.wantRuns(0)
		first := s.doWith(b, r)
		if !first.OK || s.fate(first) != "executed" {
			t.Fatalf("got %+v, want the first region to run the key", first)
		}
		// Once the record has arrived, a replays it, and refuses it reused.
		s.wantSame(first, s.doWith(a, r))
		s.wantReason(s.doWith(a, Request{Key: "k1", Amount: 200, FirstRegion: "b"}), idemkey.ReasonKeyReused)
		s.wantRuns(1)
		// A key first sent to a, or with no first region, is a's to run;
		// one first sent to b longer ago than the retention is expired.
		for _, r := range []Request{{Key: "k2", Amount: 100, FirstRegion: "a"}, {Key: "k3", Amount: 100}} {
			if got := s.doWith(a, r); !got.OK || s.fate(got) != "executed" {
				t.Fatalf("got %+v, want a run", got)
			}
		}
		old := idemkey.FormatDate(time.Now().Add(-engine.DefaultRetention - time.Minute))
		s.wantReason(s.doWith(a, Request{Key: "k4", Amount: 100, FirstRegion: "b", FirstSent: old}), idemkey.ReasonKeyExpired)
		// An engine without a region reads no first region.
		if got := s.do(Request{Key: "k5", Amount: 100, FirstRegion: "b"}); !got.OK || s.fate(got) != "executed" {
			t.Fatalf("got %+v, want a run: the engine has no region", got)
		}
		s.wantRuns(4)
	}, hooks: []string{"refuse fenced", "refuse fenced", "execute executed", "replay replayed", "refuse reused",
		"execute executed", "execute executed", "refuse key_expired", "execute executed"}},
	{name: "a region fences a key on a store that cannot find", run: func(t *testing.T, s *suite) {
		if s.cfg.Atomic {
			t.Skip("atomic mode needs the store's store.Atomic, which this wrapper hides")
		}
		// Without store.Finder the fenced region reserves the key and
		// releases it at once: the key is left free for its record.
		a := s.serve(func(c *Config) { c.Region, c.Store = "a", reserveOnly{c.Store} })
		b := s.serve(func(c *Config) { c.Region = "b" })
		r := Request{Key: "k1", Amount: 100, FirstRegion: "b"}
		s.wantReason(s.doWith(a, r), idemkey.ReasonInProgress)
		s.wantRuns(0)
		first := s.doWith(b, r)
		if !first.OK || s.fate(first) != "executed" {
			t.Fatalf("got %+v, want the first region to run the key", first)
		}
		s.wantSame(first, s.doWith(a, r))
		s.wantRuns(1)
	}, hooks: []string{"refuse fenced", "execute executed", "replay replayed"}},
	{name: "a malformed first region is refused", run: func(t *testing.T, s *suite) {
		a := s.serve(func(c *Config) { c.Region = "a" })
		for _, v := range []string{"EU", "eu_west", "a,b", strings.Repeat("a", 64)} {
			s.wantReason(s.doWith(a, Request{Key: "k1", Amount: 100, FirstRegion: v}), idemkey.ReasonFirstSentInvalid)
		}
		s.wantRuns(0)
	}, hooks: []string{"refuse first_sent_invalid", "refuse first_sent_invalid", "refuse first_sent_invalid", "refuse first_sent_invalid"}},
	{name: "first call runs the handler", run: func(t *testing.T, s *suite) {
		r := s.do(Request{Key: "k1", Amount: 100})
		if !r.OK || s.fate(r) != "executed" || r.Body != "ch_acme_100_run1" {
			t.Fatalf("got %+v, want the first run's reply, marked the first execution", r)
		}
		s.wantRuns(1)
	}, hooks: []string{"execute executed"}},
	{name: "every answer states the key's fate", run: func(t *testing.T, s *suite) {
		// The handler ran under the key: first execution, whether its
		// outcome was recorded, released, or a stand-in took its place.
		s.wantFate(s.do(Request{Key: "k1", Amount: 100}), "executed")
		s.wantFate(s.do(Request{Key: "k1", Amount: 100}), "replayed")
		s.wantFate(s.do(Request{Key: "k2", Amount: 100, Behaviour: FailRecorded}), "executed")
		s.wantFate(s.do(Request{Key: "k2", Amount: 100, Behaviour: FailRecorded}), "replayed")
		s.wantFate(s.do(Request{Key: "k3", Amount: 100, Behaviour: FailReleased}), "executed")
		s.wantFate(s.do(Request{Key: "k4", Amount: 100, Behaviour: Huge}), "executed")
		s.wantFate(s.do(Request{Key: "k4", Amount: 100, Behaviour: Huge}), "replayed")
		// idemkey's refusals, and a call without a key, keep what they sent.
		s.wantFate(s.do(Request{Key: "k1", Amount: 200}), "")
		s.wantFate(s.do(Request{Key: strings.Repeat("k", idemkey.MaxKeyLen+1), Amount: 100}), "")
		s.wantFate(s.do(Request{Amount: 100}), "")
		s.wantRuns(5)
	}, hooks: []string{"execute executed", "replay replayed", "execute executed", "replay replayed", "execute executed unrecorded",
		"execute executed", "replay replayed", "refuse reused", "refuse key_invalid", "execute no_key"}},
	{name: "a key sent to an operation not covered is ignored", run: func(t *testing.T, s *suite) {
		for range 2 {
			if r := s.do(Request{Key: "k1", Uncovered: true}); !r.OK || s.fate(r) != "ignored" {
				t.Fatalf("got %+v, want a run marked ignored", r)
			}
		}
		// An error, and a key the covered operations would refuse, alike.
		if r := s.do(Request{Key: "k1", Uncovered: true, Behaviour: FailRecorded}); r.OK || r.Reason != "" || s.fate(r) != "ignored" {
			t.Fatalf("got %+v, want the handler's error marked ignored", r)
		}
		if r := s.do(Request{Key: strings.Repeat("k", idemkey.MaxKeyLen+1), Uncovered: true}); !r.OK || s.fate(r) != "ignored" {
			t.Fatalf("got %+v, want a run marked ignored", r)
		}
		// Without a key there is nothing to ignore.
		if r := s.do(Request{Uncovered: true}); !r.OK || s.fate(r) != "" {
			t.Fatalf("got %+v, want a run without a fate", r)
		}
		s.wantRuns(5)
	}},
	{name: "a store that fails open runs a key unprotected, and says so", failOpen: true, run: func(t *testing.T, s *suite) {
		for range 2 {
			if r := s.do(Request{Key: "k1", Amount: 100}); !r.OK || s.fate(r) != "ignored" || r.Expires != "" {
				t.Fatalf("got %+v, want a run marked ignored, without an expiry", r)
			}
		}
		if r := s.do(Request{Key: "k2", Amount: 100, Behaviour: FailRecorded}); r.OK || r.Reason != "" || s.fate(r) != "ignored" {
			t.Fatalf("got %+v, want the handler's error marked ignored", r)
		}
		if r := s.do(Request{Amount: 100}); !r.OK || s.fate(r) != "" {
			t.Fatalf("got %+v, want a run without a fate", r)
		}
		s.wantRuns(4)
	}, hooks: []string{"execute failed_open", "execute failed_open", "execute failed_open", "execute no_key"}},
	{name: "retry replays the first reply", run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100})
		for range 2 {
			s.wantSame(first, s.do(Request{Key: "k1", Amount: 100}))
		}
		s.wantRuns(1)
	}, hooks: []string{"execute executed", "replay replayed", "replay replayed"}},
	{name: "key reused with another request", run: func(t *testing.T, s *suite) {
		s.do(Request{Key: "k1", Amount: 100})
		s.wantReason(s.do(Request{Key: "k1", Amount: 200}), idemkey.ReasonKeyReused)
		s.wantReason(s.do(Request{Key: "k1", Amount: 100, Behaviour: FailRecorded}), idemkey.ReasonKeyReused)
		s.wantRuns(1)
	}, hooks: []string{"execute executed", "refuse reused", "refuse reused"}},
	{name: "no key runs unprotected", run: func(t *testing.T, s *suite) {
		a, b := s.do(Request{Amount: 100}), s.do(Request{Amount: 100})
		if !a.OK || !b.OK || a.Body == b.Body || b.Replayed {
			t.Fatalf("got %+v and %+v, want two runs", a, b)
		}
		s.wantRuns(2)
	}, hooks: []string{"execute no_key", "execute no_key"}},
	{name: "no key refused when required", keyRequired: true, run: func(t *testing.T, s *suite) {
		s.wantReason(s.do(Request{Amount: 100}), idemkey.ReasonKeyMissing)
		s.wantRuns(0)
	}, hooks: []string{"refuse key_missing"}},
	{name: "malformed key refused", run: func(t *testing.T, s *suite) {
		s.wantReason(s.do(Request{Key: strings.Repeat("k", idemkey.MaxKeyLen+1), Amount: 100}), idemkey.ReasonKeyInvalid)
		s.wantReason(s.do(Request{Key: "k1", KeyTwice: true, Amount: 100}), idemkey.ReasonKeyInvalid)
		s.wantRuns(0)
	}, hooks: []string{"refuse key_invalid", "refuse key_invalid"}},
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
		replay := s.do(Request{Key: "k1", Amount: 100, Behaviour: Block})
		s.wantSame(first, replay)
		s.wantRuns(1)
		// In progress tells the key's expiry too: the record's own, the same
		// instant in atomic mode, where the record is not committed yet.
		exp := s.wantExpires(first)
		if dupExp, err := idemkey.ParseDate(dup.Expires); err != nil || !dupExp.Equal(exp) {
			t.Errorf("in progress told the expiry %q, and the reply %s: want the same instant", dup.Expires, first.Expires)
		}
	}, hooks: []string{"refuse in_progress", "execute executed", "replay replayed"}},
	{name: "recorded error replays", run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100, Behaviour: FailRecorded})
		if first.OK || first.Reason != "" || !strings.Contains(first.Body, "declined") {
			t.Fatalf("got %+v, want the handler's final error", first)
		}
		s.wantSame(first, s.do(Request{Key: "k1", Amount: 100, Behaviour: FailRecorded}))
		s.wantRuns(1)
	}, hooks: []string{"execute executed", "replay replayed"}},
	{name: "released error runs again", run: func(t *testing.T, s *suite) {
		a := s.do(Request{Key: "k1", Amount: 100, Behaviour: FailReleased})
		b := s.do(Request{Key: "k1", Amount: 100, Behaviour: FailReleased})
		if a.OK || b.OK || b.Replayed || a.Body == b.Body {
			t.Fatalf("got %+v and %+v, want two runs that failed", a, b)
		}
		s.wantRuns(2)
	}, hooks: []string{"execute executed unrecorded", "execute executed unrecorded"}},
	{name: "tenants do not share keys", run: func(t *testing.T, s *suite) {
		a := s.do(Request{Tenant: "acme", Key: "k1", Amount: 100})
		b := s.do(Request{Tenant: "globex", Key: "k1", Amount: 100})
		if !a.OK || !b.OK || b.Replayed || a.Body == b.Body {
			t.Fatalf("got %+v and %+v, want a run for each tenant", a, b)
		}
		s.wantRuns(2)
	}, hooks: []string{"execute executed", "execute executed"}},
	{name: "store down fails closed", down: true, run: func(t *testing.T, s *suite) {
		s.wantReason(s.do(Request{Key: "k1", Amount: 100}), idemkey.ReasonStoreUnavailable)
		s.wantRuns(0)
	}, hooks: []string{"refuse store_unavailable"}},
	{name: "no room for the record never runs twice", refuses: true, run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100})
		if first.OK || first.Status != s.a.Status["internal"] {
			t.Fatalf("got %+v, want the internal error that takes the reply's place", first)
		}
		// Nothing could be recorded, so the key stays in progress until its
		// lease ends: never released, since the handler has run.
		s.wantReason(s.do(Request{Key: "k1", Amount: 100}), idemkey.ReasonInProgress)
		s.wantRuns(1)
	}, hooks: []string{"execute executed unrecorded", "refuse in_progress"}},
	{name: "sealed reply replays", sealed: true, run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100})
		if !first.OK {
			t.Fatalf("first call: %+v", first)
		}
		s.wantSame(first, s.do(Request{Key: "k1", Amount: 100}))
		failed := s.do(Request{Key: "k2", Amount: 100, Behaviour: FailRecorded})
		s.wantSame(failed, s.do(Request{Key: "k2", Amount: 100, Behaviour: FailRecorded}))
		s.wantRuns(2)
	}, hooks: []string{"execute executed", "replay replayed", "execute executed", "replay replayed"}},
	{name: "rotated key still replays old records", sealed: true, run: func(t *testing.T, s *suite) {
		old := s.do(Request{Key: "k1", Amount: 100})
		// Another replica, whose primary key is new and whose previous key is
		// the one k1 was sealed with.
		rotated := s.serve(func(c *Config) { c.Sealer = sealtest.Ring(t, 2, 1) })
		s.wantSame(old, s.doWith(rotated, Request{Key: "k1", Amount: 100}))
		fresh := s.doWith(rotated, Request{Key: "k2", Amount: 100})
		s.wantSame(fresh, s.doWith(rotated, Request{Key: "k2", Amount: 100}))
		// A replica that has only the old key refuses what the new key
		// sealed, and does not run it again.
		s.wantReason(s.do(Request{Key: "k2", Amount: 100}), idemkey.ReasonStoreUnavailable)
		// One without a sealer refuses every sealed record.
		plain := s.serve(func(c *Config) { c.Sealer = nil })
		s.wantReason(s.doWith(plain, Request{Key: "k1", Amount: 100}), idemkey.ReasonStoreUnavailable)
		s.wantRuns(2)
	}, hooks: []string{"execute executed", "replay replayed", "execute executed", "replay replayed", "refuse store_unavailable", "refuse store_unavailable"}},
	{name: "record that does not open fails closed", sealed: true, tampered: true, run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100})
		if !first.OK {
			t.Fatalf("first call: %+v", first)
		}
		for range 2 {
			s.wantReason(s.do(Request{Key: "k1", Amount: 100}), idemkey.ReasonStoreUnavailable)
		}
		s.do(Request{Key: "k2", Amount: 100, Behaviour: FailRecorded})
		s.wantReason(s.do(Request{Key: "k2", Amount: 100, Behaviour: FailRecorded}), idemkey.ReasonStoreUnavailable)
		// The same key with another request is still refused as reused: its
		// record's outcome is never read.
		s.wantReason(s.do(Request{Key: "k1", Amount: 200}), idemkey.ReasonKeyReused)
		s.wantRuns(2)
	}, hooks: []string{"execute executed", "refuse store_unavailable", "refuse store_unavailable", "execute executed", "refuse store_unavailable", "refuse reused"}},
	{name: "redacted reply is what every retry gets", sealed: true, redact: true, run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100})
		if !first.OK || first.Body != "ch_acme_100_run1" {
			t.Fatalf("first call: %+v, want the whole reply", first)
		}
		want := first
		want.Body = Redact(first.Body)
		for range 2 {
			s.wantSame(want, s.do(Request{Key: "k1", Amount: 100}))
		}
		failed := s.do(Request{Key: "k2", Amount: 100, Behaviour: FailRecorded})
		if failed.Body != "declined ch_acme_100_run2" {
			t.Fatalf("first call: %+v, want the whole error", failed)
		}
		want = failed
		want.Body = Redact(failed.Body)
		s.wantSame(want, s.do(Request{Key: "k2", Amount: 100, Behaviour: FailRecorded}))
		s.wantRuns(2)
	}, hooks: []string{"execute executed", "replay replayed", "replay replayed", "execute executed", "replay replayed"}},
	{name: "a panicking hook changes nothing", run: func(t *testing.T, s *suite) {
		s.hooks.panics.Store(true)
		first := s.do(Request{Key: "k1", Amount: 100})
		if !first.OK || first.Replayed || first.Body != "ch_acme_100_run1" {
			t.Fatalf("got %+v, want the first run's reply, whatever the hook did", first)
		}
		s.wantSame(first, s.do(Request{Key: "k1", Amount: 100}))
		s.wantReason(s.do(Request{Key: "k1", Amount: 200}), idemkey.ReasonKeyReused)
		s.wantRuns(1)
	}, hooks: []string{"execute executed", "replay replayed", "refuse reused"}},
	{name: "reply too large records an error", run: func(t *testing.T, s *suite) {
		first := s.do(Request{Key: "k1", Amount: 100, Behaviour: Huge})
		if first.OK || first.Status != s.a.Status["internal"] {
			t.Fatalf("got %+v, want the internal error that takes the reply's place", first)
		}
		s.wantSame(first, s.do(Request{Key: "k1", Amount: 100, Behaviour: Huge}))
		s.wantRuns(1)
	}, hooks: []string{"execute executed", "replay replayed"}},
}

// hookRecorder is the application's hooks in every case: it keeps each
// event, and then panics if told to, as a buggy hook would.
type hookRecorder struct {
	mu       sync.Mutex
	events   []hookEvent
	requests []Request // of the calls answered, in order
	replies  []Reply
	panics   atomic.Bool
}

type hookEvent struct {
	hook string // execute, replay, refuse
	ev   engine.Event
}

func (h *hookRecorder) hooks() engine.Hooks {
	keep := func(hook string) func(context.Context, engine.Event) {
		return func(ctx context.Context, ev engine.Event) {
			h.mu.Lock()
			h.events = append(h.events, hookEvent{hook, ev})
			h.mu.Unlock()
			if h.panics.Load() {
				panic(fmt.Sprintf("audit failed for %s/%s", ev.Tenant, ev.Key))
			}
		}
	}
	return engine.Hooks{OnExecute: keep("execute"), OnReplay: keep("replay"), OnRefuse: keep("refuse")}
}

// answered notes a call and the reply its caller saw.
func (h *hookRecorder) answered(r Request, reply Reply) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.requests, h.replies = append(h.requests, r), append(h.replies, reply)
}

// String is how a case names an event: "execute executed", with
// " unrecorded" for an execution whose outcome was not recorded.
func (e hookEvent) String() string {
	s := e.hook + " " + e.ev.Verdict.String()
	if e.ev.Verdict == engine.Executed && !e.ev.Recorded {
		s += " unrecorded"
	}
	return s
}

// wantHooks checks the hooks the case's calls ran: one per call, in the
// order of their answers, since each runs before its answer is sent. Each
// is told the status the caller got, the tenant and key it sent (none for
// a call refused before its key was read), and the size of the record, the
// same for the execution and its replays.
func (s *suite) wantHooks(want ...string) {
	s.t.Helper()
	h := s.hooks
	h.mu.Lock()
	defer h.mu.Unlock()
	got := make([]string, len(h.events))
	for i, e := range h.events {
		got[i] = e.String()
	}
	if strings.Join(got, ", ") != strings.Join(want, ", ") || len(h.events) != len(h.replies) {
		s.t.Fatalf("hooks ran: %q, for %d calls; want %q", got, len(h.replies), want)
	}
	recorded := 0
	for i, e := range h.events {
		ev, r, reply := e.ev, h.requests[i], h.replies[i]
		if ev.Code != reply.Status {
			s.t.Errorf("%s: code %d, but the caller got %d", e, ev.Code, reply.Status)
		}
		if ev.Operation == "" || ev.Operation != h.events[0].ev.Operation {
			s.t.Errorf("%s: operation %q, want the one operation of every call", e, ev.Operation)
		}
		switch ev.Verdict {
		case engine.NoKey, engine.KeyMissing, engine.KeyInvalid, engine.FirstSentInvalid:
			if ev.Key != "" || ev.Tenant != "" {
				s.t.Errorf("%s: tenant %q and key %q, want neither: the call ended before they were read", e, ev.Tenant, ev.Key)
			}
		default:
			if ev.Key != r.Key || ev.Tenant != r.Tenant {
				s.t.Errorf("%s: tenant %q and key %q, want the caller's, %q and %q", e, ev.Tenant, ev.Key, r.Tenant, r.Key)
			}
		}
		switch {
		case ev.Verdict == engine.Executed && ev.Recorded:
			if ev.Size <= 0 {
				s.t.Errorf("%s: size %d, want the record's", e, ev.Size)
			}
			recorded = ev.Size
		case ev.Verdict == engine.Replayed:
			if ev.Size <= 0 || ev.Size != recorded {
				s.t.Errorf("%s: size %d, want the size of the record made, %d", e, ev.Size, recorded)
			}
		case ev.Size != 0 || ev.Recorded:
			s.t.Errorf("%s: size %d, recorded %v; want no record", e, ev.Size, ev.Recorded)
		}
	}
	h.events, h.requests, h.replies = nil, nil, nil
}

// refusing is a store with no room for any record: its Complete answers
// store.ErrFull, even for an outcome of store.SmallOutcome bytes.
type refusing struct{ store.Store }

func (refusing) Complete(context.Context, store.Key, store.Token, []byte) error {
	return store.ErrFull
}

// Tampering returns st altering one byte of every completed record it reads
// back (Reserve, Find, Begin), as someone with write access to the store
// would: a sealed record then does not open. It is a store.Finder and a
// store.Atomic when st is.
func Tampering(st store.Store) store.Store {
	t := tampering{st}
	if _, ok := st.(store.Atomic); ok {
		return tamperingAtomic{t}
	}
	return t
}

type tampering struct{ store.Store }

func tamper(res store.Entry) store.Entry {
	if res.State == store.Completed && len(res.Outcome) > 0 {
		res.Outcome = bytes.Clone(res.Outcome)
		res.Outcome[len(res.Outcome)-1] ^= 1
	}
	return res
}

func (t tampering) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	res, err := t.Store.Reserve(ctx, r)
	return tamper(res), err
}

func (t tampering) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	f, ok := t.Store.(store.Finder)
	if !ok {
		return store.Entry{}, false, nil
	}
	res, found, err := f.Find(ctx, key)
	return tamper(res), found, err
}

type tamperingAtomic struct{ tampering }

func (t tamperingAtomic) Begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	res, tx, err := t.Store.(store.Atomic).Begin(ctx, r)
	return tamper(res), tx, err
}

// reserveOnly is a store without its store.Finder and other optional
// methods.
type reserveOnly struct{ store.Store }

// ErrDown is the error of a store that is down.
var ErrDown = errors.New("adaptertest: the store is down")
