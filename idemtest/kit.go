package idemtest

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Chaos is what a Kit does to each call that carries an idempotency key,
// and how it counts the call's effects. The zero Chaos sends each call
// once and checks nothing but its key.
type Chaos struct {
	// DropReply drops the reply of each call's first attempt, as a network
	// that loses it does, and sends the call again with the same key: the
	// retry must get the same answer, marked replayed.
	DropReply bool
	// Duplicates sends this many more attempts of each call at once beside
	// its first, with its key: one runs the handler, and the others get its
	// answer, replayed.
	Duplicates int
	// Cancel cancels each call's first attempt while the server holds its
	// key (once Effects counts the effect, or a duplicate hears "in
	// progress"), and then sends the call again: a handler cut short must
	// leave neither half an effect nor a second one. A first attempt that
	// ends before either sign is not cancelled, and the report says so.
	Cancel bool
	// LoseReply answers the caller's first call Unavailable after it ran, as
	// a lost reply looks to a client, and takes the caller's next call as its
	// retry, which must carry the same key. The other faults check the
	// server; this one checks the client's own retry.
	LoseReply bool
	// Effects counts the effects of the operation under test (a SELECT
	// count(*) of its rows, the calls a fake provider got), read before and
	// after each call: a call answered with success must leave exactly one,
	// an error none. It must count only what the test's own calls do. Nil
	// counts nothing.
	Effects func(ctx context.Context) (int, error)
}

// Kit applies its Chaos to each call that carries an idempotency key,
// through a transport's adapter (UnaryClientInterceptor, RoundTripper,
// idemconnecttest.Interceptor, or Call for another), and fails its test
// with the attempts' report when one call's attempts disagree or its
// effects are not one per key. It checks one call at a time: calls made at
// once through one Kit wait for each other, so that each call's effects are
// its own.
type Kit struct {
	t     testing.TB
	chaos Chaos

	mu    sync.Mutex // one call at a time
	lost  *call      // the call whose reply LoseReply lost, until its retry
	calls int        // calls that carried a key
}

// New returns a Kit that reports to t. When t ends, it fails t if no call
// carried a key (the kit then checked nothing: chain it after the key
// interceptor), or if a call whose reply LoseReply lost was never retried.
func New(t testing.TB, chaos Chaos) *Kit {
	t.Helper()
	if chaos.Duplicates < 0 {
		t.Fatalf("idemtest: Chaos.Duplicates is %d; want 0 or more", chaos.Duplicates)
	}
	k := &Kit{t: t, chaos: chaos}
	t.Cleanup(k.finish)
	return k
}

func (k *Kit) finish() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.calls == 0 {
		k.t.Errorf("idemtest: no call through the kit carried an idempotency key, so none was checked: chain the kit after the client's key interceptor (or set the key before the call), and make at least one call of an operation with a key")
	}
	if k.lost != nil {
		k.t.Errorf("idemtest: the caller never retried the call whose reply was lost (Chaos.LoseReply): a client must retry a call that got no answer, with the same key\n%s", k.lost.table())
	}
}

// Try is what one attempt of a call got, as a transport's adapter
// reads it for Call; the Kit sets Role.
type Try struct {
	// Code is the transport's code of the answer: "OK" or "NotFound" for
	// gRPC, "ok" or "not_found" for Connect, "201" or "409" for HTTP.
	Code string
	// Failed is true for an error answer.
	Failed bool
	// Reply is the reply, or the error's message, as text. Attempts are
	// compared on Code and Reply.
	Reply string
	// Replayed is true when the answer was marked replayed from the key's
	// record (Idempotent-Replayed, idempotent-replayed).
	Replayed bool
	// InProgress is true for idemkey's answer that the key is in progress:
	// the Kit sends the attempt again after RetryAfter.
	InProgress bool
	RetryAfter time.Duration
	// NoAnswer is true when the attempt got no answer (it was cancelled,
	// timed out or lost its connection): it is reported, not compared.
	NoAnswer bool
	// Role is what the Kit made of the attempt: "first", "duplicate",
	// "cancelled mid-handler", "probe", "retry after the dropped reply", ...
	Role string
}

// call is one operation's attempts, with one key, and its effects.
type call struct {
	key      string
	before   int  // Effects before the first attempt
	counted  bool // before was read
	lost     bool // its first reply was lost (Chaos.LoseReply); its retry follows
	attempts []Try
	mu       sync.Mutex // attempts, from concurrent duplicates
	notes    []string
}

func (c *call) add(a Try) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.attempts = append(c.attempts, a)
}

// table is the report of c's attempts, one line each.
func (c *call) table() string {
	var b strings.Builder
	for i, a := range c.attempts {
		fmt.Fprintf(&b, "\tattempt %d (%s): %s\n", i+1, a.Role, describe(a))
	}
	for _, n := range c.notes {
		fmt.Fprintf(&b, "\t%s\n", n)
	}
	return b.String()
}

// describe is one attempt's answer, in a few words and its reply.
func describe(a Try) string {
	switch {
	case a.NoAnswer:
		return "no answer: " + shorten(a.Reply)
	case a.InProgress:
		return a.Code + ", still in progress"
	}
	how := "ran"
	if a.Replayed {
		how = "replayed"
	}
	return fmt.Sprintf("%s, %s: %s", a.Code, how, shorten(a.Reply))
}

// shorten keeps a report's line short.
func shorten(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 160 {
		return s[:160] + "..."
	}
	return s
}

// Limits of the Kit's waits: how often an attempt is sent again while its
// key is in progress, and how long it waits between two sends at most.
const (
	inProgressTries = 40
	maxInProgress   = time.Second
	// A probe's deadline starts short, so that the server answers "in
	// progress" at once rather than hold it, and doubles after each probe
	// that got no answer in time (a busy machine), up to more than the
	// engine's longest hold of a duplicate.
	firstProbeTimeout = 100 * time.Millisecond
	maxProbeTimeout   = 5 * time.Second
)

// Call makes one call of the operation under the Kit's Chaos: key is the
// key the call carries, and send sends attempt n of it (from 0; attempts
// may be sent at once, so send must be safe for concurrent use). It returns
// the attempt whose answer the caller gets, or lost (Chaos.LoseReply): the
// adapter then answers as a lost reply looks on its transport. Every
// attempt is checked against the others, and the call's effects counted,
// before Call returns, or, for a lost reply, with its retry.
//
// The adapters of this package and idemconnecttest are built on it; an
// adapter for another transport reads each answer into a Try.
func (k *Kit) Call(ctx context.Context, key string, send func(ctx context.Context, n int) Try) (n int, lost bool) {
	k.t.Helper()
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls++
	r := &run{k: k, send: send}
	c := k.lost
	if c != nil {
		k.lost = nil
		if key != c.key {
			k.t.Errorf("idemtest: the caller's retry of a call whose reply was lost sent another idempotency key than the call: a key made per attempt, so the server runs the operation again. Make the key once per operation and send it on every attempt (idemkey.NewKey before the retry loop, then interceptor.UseKey, idemkey.ContextWithKey or the Idempotency-Key header), and chain a retry interceptor inside the key interceptor, not outside it")
			c.notes = append(c.notes, "the retry after the lost reply carried another key")
		}
	} else {
		c = &call{key: key}
		c.before, c.counted = k.effects(ctx)
	}
	r.c = c
	n = r.attempts(ctx, !c.lost)
	if k.chaos.LoseReply && !c.lost {
		c.notes = append(c.notes, "the caller got no reply (Chaos.LoseReply): its next call is the retry")
		c.lost, k.lost = true, c
		return n, true
	}
	k.check(ctx, c)
	return n, false
}

// run is one Call's sending: its call, and the numbers of its sends.
type run struct {
	k     *Kit
	c     *call
	send  func(ctx context.Context, n int) Try
	next  atomic.Int32
	probe time.Duration // the next probe's deadline; 0: the first's
}

// attempts sends the attempts the Chaos asks for, and returns the number of
// the send whose answer the caller gets. first is false for a caller's
// retry after a lost reply, which is sent once, as it is.
func (r *run) attempts(ctx context.Context, first bool) int {
	ch := r.k.chaos
	if !first {
		return r.attempt(ctx, "the caller's retry after the lost reply")
	}
	role := "first"
	if ch.Cancel {
		role = "retry after the first attempt"
		if r.cancelFirst(ctx) {
			role = "retry after the cancelled attempt"
		}
	}
	ns := make([]int, 1+ch.Duplicates)
	var wg sync.WaitGroup
	for i := range ns {
		wg.Go(func() {
			if i == 0 {
				ns[i] = r.attempt(ctx, role)
			} else {
				ns[i] = r.attempt(ctx, "duplicate")
			}
		})
	}
	wg.Wait()
	if ch.DropReply {
		r.c.notes = append(r.c.notes, "the reply of the first non-duplicate attempt was dropped (Chaos.DropReply)")
		return r.attempt(ctx, "retry after the dropped reply")
	}
	return ns[0]
}

// attempt sends one attempt, again while its key is in progress, and
// returns the number of its last send.
func (r *run) attempt(ctx context.Context, role string) int {
	for try := 1; ; try++ {
		n := int(r.next.Add(1)) - 1
		a := r.send(ctx, n)
		if !a.InProgress || try == inProgressTries || ctx.Err() != nil {
			a.Role = role
			r.c.add(a)
			return n
		}
		wait := min(max(a.RetryAfter, 10*time.Millisecond), maxInProgress)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
}

// cancelFirst sends a first attempt and cancels it once the server holds
// its key: once Effects counts more than before, or a probe (an attempt
// with a short deadline) hears that the key is in progress. It reports
// whether it cancelled the attempt before it ended.
func (r *run) cancelFirst(ctx context.Context) bool {
	first, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan Try, 1)
	go func() {
		n := int(r.next.Add(1)) - 1
		done <- r.send(first, n)
	}()
	for interval := 5 * time.Millisecond; ; interval = min(2*interval, 200*time.Millisecond) {
		select {
		case a := <-done:
			a.Role = "first, ended before it could be cancelled"
			r.c.add(a)
			return false
		case <-time.After(interval):
		}
		if r.holding(ctx) {
			cancel()
			a := <-done
			a.Role = "cancelled mid-handler"
			r.c.add(a)
			return true
		}
	}
}

// holding reports whether the server shows that it holds the call's key:
// its effect counted, or a probe answered "in progress".
func (r *run) holding(ctx context.Context) bool {
	if r.c.counted {
		if now, ok := r.k.effects(ctx); ok && now > r.c.before {
			return true
		}
	}
	if r.probe == 0 {
		r.probe = firstProbeTimeout
	}
	probe, cancel := context.WithTimeout(ctx, r.probe)
	defer cancel()
	n := int(r.next.Add(1)) - 1
	a := r.send(probe, n)
	switch {
	case a.InProgress:
		return true
	case a.NoAnswer:
		// It may have reached the handler before the first attempt did,
		// and been cut short there in its place: reported, not compared.
		a.Role = "probe, cut short by its deadline"
		r.c.add(a)
		r.probe = min(2*r.probe, maxProbeTimeout)
	default:
		a.Role = "probe"
		r.c.add(a)
	}
	return false
}

// effects reads Chaos.Effects; ok is false without it, or if it failed.
func (k *Kit) effects(ctx context.Context) (n int, ok bool) {
	if k.chaos.Effects == nil {
		return 0, false
	}
	n, err := k.chaos.Effects(context.WithoutCancel(ctx))
	if err != nil {
		k.t.Errorf("idemtest: Chaos.Effects failed: %v", err)
		return 0, false
	}
	return n, true
}

// check fails the test if c's attempts got different answers, if more than
// one of them ran a successful call, or if its effects are not one for a
// success and none for an error.
func (k *Kit) check(ctx context.Context, c *call) {
	k.t.Helper()
	var answered []int
	for i, a := range c.attempts {
		if !a.NoAnswer {
			answered = append(answered, i)
		}
	}
	var problems []string
	if len(answered) == 0 {
		problems = append(problems, "no attempt of the call got an answer")
	}
	var ref Try
	if len(answered) > 0 {
		ref = c.attempts[answered[0]]
	}
	ran := 0
	for _, i := range answered {
		a := c.attempts[i]
		if a.InProgress {
			problems = append(problems, fmt.Sprintf("attempt %d was still told the key is in progress after %d tries: the first run never ended", i+1, inProgressTries))
			continue
		}
		if !a.Replayed {
			ran++
		}
		if a.Code != ref.Code || a.Reply != ref.Reply {
			problems = append(problems, differ(answered[0], ref, i, a))
		}
	}
	if !ref.Failed && ran > 1 {
		problems = append(problems, fmt.Sprintf("%d attempts with one key got a reply not marked replayed: the server ran the operation for each (is the method covered by idemkey's interceptor, with its key required?), or does not mark replays", ran))
	}
	if c.counted {
		if after, ok := k.effects(ctx); ok {
			problems = append(problems, effectProblems(ref, after-c.before)...)
			c.notes = append(c.notes, fmt.Sprintf("effects counted: %d", after-c.before))
		}
	}
	if len(problems) > 0 {
		k.t.Errorf("idemtest: %s\n%s", strings.Join(problems, "\nidemtest: "), c.table())
		return
	}
	k.t.Logf("idemtest: %d attempts of one key agree: %s\n%s", len(c.attempts), ref.Code, c.table())
}

// differ says how attempt j's answer b differs from attempt i's a.
func differ(i int, a Try, j int, b Try) string {
	why := "the handler ran again and answered otherwise (its reply depends on more than the request), or the server does not record replies"
	if b.Replayed {
		why = "a replay differs from the answer it replays"
	}
	if a.Code != b.Code {
		return fmt.Sprintf("attempt %d got %s where attempt %d got %s: %s", j+1, b.Code, i+1, a.Code, why)
	}
	return fmt.Sprintf("attempt %d got another reply than attempt %d (both %s): %s\n\t\tattempt %d: %s\n\t\tattempt %d: %s",
		j+1, i+1, a.Code, why, i+1, shorten(a.Reply), j+1, shorten(b.Reply))
}

// effectProblems says what is wrong with n effects of a call answered ref:
// a success makes one, an error none.
func effectProblems(ref Try, n int) []string {
	switch {
	case ref.NoAnswer:
		return nil
	case !ref.Failed && n == 0:
		return []string{fmt.Sprintf("the call succeeded (%s), yet Chaos.Effects counted no effect: does it count this operation's effects?", ref.Code)}
	case !ref.Failed && n > 1:
		return []string{fmt.Sprintf("one key, %d effects: the operation took effect more than once. A handler cut short or run twice made its effect again: make the effect once per key (in atomic mode, through postgres.TxFromContext's transaction; in two-phase mode, not in a context the caller can cancel)", n)}
	case ref.Failed && n > 0:
		return []string{fmt.Sprintf("the call answered %s, yet left %d effect(s): a side effect before an error. A recorded error tells every retry the operation failed while its effect stands, and a released one lets a retry make it again. In two-phase mode, answer success once the effect is made (or undo it before failing); in atomic mode, write through postgres.TxFromContext, whose writes an error rolls back", ref.Code, n)}
	}
	return nil
}
