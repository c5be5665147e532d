package idemtest

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
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
	// key, and then sends the call again: a handler cut short must leave
	// neither half an effect nor a second one. The server half
	// (UnaryServerInterceptor) makes the cancellation land every time;
	// without it, a first attempt that ends first is not cancelled, and the
	// report says so.
	Cancel bool
	// LoseReply answers the caller's first call Unavailable after it ran, as
	// a lost reply looks to a client, and takes the caller's next call as its
	// retry, which must carry the same key. The other faults check the
	// server; this one checks the client's own retry.
	LoseReply bool
	// Effects counts the effects of the operation under test, read before
	// and after each call: a success must leave exactly one, an error none.
	// It must count only the test's own calls. Nil counts nothing.
	Effects func(ctx context.Context) (int, error)
}

// Kit applies its Chaos to each call that carries an idempotency key,
// through a transport's adapter, and fails its test with the attempts'
// report when one call's attempts disagree or its effects are not one per
// key. Calls made at once through one Kit wait for each other, so that each
// call's effects are its own.
type Kit struct {
	t     testing.TB
	chaos Chaos

	mu    sync.Mutex // one call at a time
	lost  *call      // the call whose reply LoseReply lost, until its retry
	calls int        // calls that carried a key
	// last is Effects after the last call was checked, to find effects
	// that come after a call's reply; valid if lastOK.
	last   int
	lastOK bool

	server serverHalf // UnaryServerInterceptor's state
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
	k.late(context.Background())
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
	// Reason is idemkey's reason (idemkey.ReasonKeyReused, ...) of an
	// answer that idemkey gave in the handler's place, from the status's
	// ErrorInfo or the problem's type; "" for the handler's own answer.
	// The Kit names the mistake each reason shows, rather than compare it.
	Reason string
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
	mu       sync.Mutex // attempts, runs and rolledBack, from concurrent duplicates and the server half
	notes    []string
	// cut is true when an attempt was cut short in the handler (Cancel, or
	// a probe's deadline).
	cut bool
	// runs are the codes the handler answered for the call's key, as the
	// server half saw them, in order; nil without it.
	runs []string
	// rolledBack is true when the server half rolled back the transaction
	// of the held first attempt (atomic mode).
	rolledBack bool
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
	case a.Reason != "":
		return fmt.Sprintf("%s, refused by idemkey (%s), the handler not run", a.Code, a.Reason)
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
	// With the server half, a first attempt whose handler has not returned
	// (nor counted an effect) for this long is cancelled all the same: its
	// handler may be waiting for the cancellation.
	holdPatience = 30 * time.Second
)

// Call makes one call of the operation under the Kit's Chaos, for an adapter
// of another transport: send sends attempt n (from 0) with key, and must be
// safe for concurrent use. It returns the attempt whose answer the caller
// gets, or lost (Chaos.LoseReply): the adapter then answers as a lost reply
// looks on its transport. The attempts are checked before Call returns, or,
// for a lost reply, with its retry.
func (k *Kit) Call(ctx context.Context, key string, send func(ctx context.Context, n int) Try) (n int, lost bool) {
	k.t.Helper()
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls++
	r := &run{k: k, key: key, send: send}
	c := k.lost
	if c != nil {
		k.lost = nil
		if key != c.key {
			k.t.Errorf("idemtest: the caller's retry of a call whose reply was lost sent another idempotency key than the call: a key made per attempt, so the server runs the operation again. Make the key once per operation and send it on every attempt (idemkey.NewKey before the retry loop, then interceptor.UseKey, idemkey.ContextWithKey or the Idempotency-Key header), and chain a retry interceptor inside the key interceptor, not outside it")
			c.notes = append(c.notes, "the retry after the lost reply carried another key")
		}
	} else {
		k.late(ctx)
		c = &call{key: key}
		c.before, c.counted = k.effects(ctx)
	}
	r.c = c
	k.server.watch(c, key)
	defer k.server.watch(nil, "")
	n = r.attempts(ctx, !c.lost)
	if k.chaos.LoseReply && !c.lost {
		c.notes = append(c.notes, "the caller got no reply (Chaos.LoseReply): its next call is the retry")
		c.lost, k.lost = true, c
		return n, true
	}
	k.check(ctx, c)
	return n, false
}

// run is one Call's sending.
type run struct {
	k     *Kit
	c     *call
	key   string
	send  func(ctx context.Context, n int) Try
	next  atomic.Int32
	probe time.Duration // the next probe's deadline; 0: the first's
}

// attempts sends the attempts the Chaos asks for, and returns the send whose
// answer the caller gets; a retry after a lost reply (!first) is sent once.
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
// its key (the server half holds it, Effects counts its effect, or a probe
// hears "in progress"), and reports whether it cancelled it before it ended.
func (r *run) cancelFirst(ctx context.Context) bool {
	first, cancel := context.WithCancel(ctx)
	defer cancel()
	first, held := r.k.server.arm(first)
	defer r.k.server.disarm()
	done := make(chan Try, 1)
	start := time.Now()
	go func() {
		n := int(r.next.Add(1)) - 1
		done <- r.send(first, n)
	}()
	for interval := 5 * time.Millisecond; ; interval = min(2*interval, 200*time.Millisecond) {
		select {
		case a := <-done:
			a.Role = "first, ended before it could be cancelled"
			if held != nil {
				a.Role += " (the kit's server half did not hold it: chain kit.UnaryServerInterceptor() after idemkey's interceptor on the server)"
			}
			r.c.add(a)
			return false
		case <-held:
			cancel()
			a := <-done
			a.Role = "cancelled in its call, held by the kit's server half once its handler returned"
			r.c.add(a)
			r.c.cut = true
			return true
		case <-time.After(interval):
		}
		// With the server half, only the effect, once counted, is a sign
		// that the handler runs: a probe may hear "in progress" before the
		// handler has started, and cut the attempt short before it.
		if held != nil && time.Since(start) > holdPatience {
			cancel()
			a := <-done
			a.Role = "cancelled after its handler had not returned for a long while (the server half holds an attempt once its handler returns)"
			r.c.add(a)
			r.c.cut = true
			return true
		}
		if held != nil && r.effected(ctx) || held == nil && r.holding(ctx) {
			cancel()
			a := <-done
			a.Role = "cancelled mid-handler"
			r.c.add(a)
			r.c.cut = true
			return true
		}
	}
}

// effected reports whether Effects counts more than before the call.
func (r *run) effected(ctx context.Context) bool {
	if !r.c.counted {
		return false
	}
	now, ok := r.k.effects(ctx)
	return ok && now > r.c.before
}

// holding reports whether the server shows that it holds the call's key:
// its effect counted, or a probe answered "in progress".
func (r *run) holding(ctx context.Context) bool {
	if r.effected(ctx) {
		return true
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
		r.c.cut = true
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

// late fails the test if Effects counts more than it did once the last
// call was checked: an effect that came after that call's reply.
func (k *Kit) late(ctx context.Context) {
	if !k.lastOK {
		return
	}
	k.lastOK = false
	if now, ok := k.effects(ctx); ok && now > k.last {
		k.t.Errorf("idemtest: Chaos.Effects counted %d more effect(s) after the last call had been answered and checked: %s", now-k.last, afterReply)
	}
}

// afterReply is what an effect counted only after its call's reply means.
const afterReply = "the handler makes its effect after its reply (in a goroutine it does not wait for, or after the answer is written). idemkey records a call's reply when its handler returns, so an effect made later is outside the key's protection: lost if the process dies after the reply, and outside the call's transaction in atomic mode. Make the effect before the handler returns (or, if Effects counts more than the test's calls through the Kit, count only those)"

// Re-reads of Effects after a success that counted no effect, to tell an
// effect made after the reply from a count that misses the effect.
const (
	settleTries    = 8
	settleInterval = 10 * time.Millisecond
	maxSettle      = 500 * time.Millisecond
)

// settle re-reads Effects a few times, waiting longer each time, until it
// counts more than before, and returns its last count.
func (k *Kit) settle(ctx context.Context, before int) (n int, ok bool) {
	n, ok = before, true
	wait := settleInterval
	for range settleTries {
		time.Sleep(wait)
		if n, ok = k.effects(ctx); !ok || n > before {
			return n, ok
		}
		wait = min(2*wait, maxSettle)
	}
	return n, ok
}

// check fails the test if c's attempts disagree, more than one succeeded by
// running, idemkey refused one, or its effects are not one for a success and
// none for an error. An error that a later attempt ran past was released:
// the later answer is the call's.
func (k *Kit) check(ctx context.Context, c *call) {
	k.t.Helper()
	var (
		problems []string
		answered []int                   // by the handler or its record
		refused  = make(map[string]bool) // idemkey's reasons, named once each
	)
	for i, a := range c.attempts {
		switch {
		case a.NoAnswer:
		case a.InProgress:
			problems = append(problems, fmt.Sprintf("attempt %d was still told the key is in progress after %d tries: the first run never ended", i+1, inProgressTries))
		case a.Reason != "":
			if !refused[a.Reason] {
				refused[a.Reason] = true
				problems = append(problems, refusal(i, a))
			}
		default:
			answered = append(answered, i)
		}
	}
	released := releasedAttempts(c.attempts, answered)
	var ref Try
	refIndex := -1
	for _, i := range answered {
		if !released[i] {
			ref, refIndex = c.attempts[i], i
			break
		}
	}
	if len(answered) == 0 && len(problems) == 0 {
		problems = append(problems, "no attempt of the call got an answer")
	}
	ran := 0
	for _, i := range answered {
		a := c.attempts[i]
		if released[i] {
			continue
		}
		if !a.Replayed {
			ran++
		}
		if a.Code != ref.Code || a.Reply != ref.Reply {
			problems = append(problems, differ(refIndex, ref, i, a))
		}
	}
	if refIndex >= 0 && !ref.Failed && ran > 1 {
		problems = append(problems, fmt.Sprintf("%d attempts with one key got a reply not marked replayed: the server ran the operation for each (is the method covered by idemkey's interceptor, with its key required?), or does not mark replays", ran))
	}
	if c.counted {
		if after, ok := k.effects(ctx); ok {
			n := after - c.before
			if refIndex >= 0 && !ref.Failed && n == 0 {
				if late, ok := k.settle(ctx, after); ok && late > after {
					problems = append(problems, fmt.Sprintf("the call succeeded (%s), yet Chaos.Effects counted no effect when it answered, and %d a moment later: %s", ref.Code, late-after, afterReply))
					after = late
				} else {
					problems = append(problems, fmt.Sprintf("the call succeeded (%s), yet Chaos.Effects counted no effect, even a moment later. Either Effects does not count this operation's effects (count what the call makes: its rows, the calls a fake provider got), or %s", ref.Code, afterReply))
				}
			} else if refIndex >= 0 {
				problems = append(problems, c.effectProblems(ref, n, released)...)
			}
			c.notes = append(c.notes, fmt.Sprintf("effects counted: %d", n))
			k.last, k.lastOK = after, true
		}
	}
	if runs := c.runCodes(); len(runs) > 0 {
		c.notes = append(c.notes, fmt.Sprintf("the handler's runs for this key, as the kit's server half saw them: %s", strings.Join(runs, ", ")))
	}
	if len(problems) > 0 {
		k.t.Errorf("idemtest: %s\n%s", strings.Join(problems, "\nidemtest: "), c.table())
		return
	}
	k.t.Logf("idemtest: %d attempts of one key agree: %s\n%s", len(c.attempts), ref.Code, c.table())
}

// releasedAttempts are the answered attempts whose error was released, not
// recorded: an attempt answered after them ran the handler again (its
// answer is not marked replayed).
func releasedAttempts(attempts []Try, answered []int) map[int]bool {
	released := make(map[int]bool)
	for x, i := range answered {
		a := attempts[i]
		if !a.Failed || a.Replayed {
			continue
		}
		for _, j := range answered[x+1:] {
			if !attempts[j].Replayed {
				released[i] = true
				break
			}
		}
	}
	return released
}

// refusal names the mistake that idemkey's refusal of attempt i, a, shows,
// and its fix. It quotes the answer's code and reason, never its message.
func refusal(i int, a Try) string {
	what := fmt.Sprintf("attempt %d was refused by idemkey (%s, %s), and the handler did not run", i+1, a.Code, a.Reason)
	switch a.Reason {
	case idemkey.ReasonKeyReused:
		return what + ": the key was used before with another request. The client sends one key for two operations: make a new key for each operation (idemkey.NewKey once per operation, or leave it to the key interceptor), and send a kept key only with the request it was made for"
	case idemkey.ReasonKeyExpired:
		return what + ": the call was first sent longer ago than the server keeps keys (its retention), so idemkey will not run it again. The client retried a key kept past the retention, or sent a stale first-sent time: retry a kept key only within the retention (idemkey-key-expires says until when); after it, check the operation's state and use a new key"
	case idemkey.ReasonFirstSentInvalid:
		return what + ": the call's first-sent time is malformed or in the future. Send the time the key was made, once per operation, as idemkey.FormatDate writes it (the key interceptor does), from a clock in step with the server's"
	case idemkey.ReasonKeyMissing:
		return what + ": the server saw no key, though the call carried one. Something between the client and idemkey drops it: a proxy, a gateway's header matcher (idemgateway.ServeMuxOptions), or an interceptor chained before idemkey's that rewrites the metadata"
	case idemkey.ReasonKeyInvalid:
		return what + ": the server read the key as malformed, or sent twice. Send one key value per call (set the header or metadata once, not appended by two interceptors)"
	case idemkey.ReasonStoreUnavailable:
		return what + ": idemkey's store was unavailable or failing, so the server refused the call rather than run it unguarded, and the kit checked nothing of the handler. Make the test's store reachable and ready (postgres.Migrate on its schema) before the calls"
	case idemkey.ReasonStoreFull:
		return what + ": idemkey's store had no room for the key and its reply, so the kit checked nothing of the handler. Give the test's store room (its bounds on records and bytes)"
	}
	return what
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

// releasedFix is the fix of an effect that a released error left for a
// retry to make again.
const releasedFix = "Once the effect is made, answer its success whatever the context says, or undo the effect before failing; in atomic mode, write through postgres.TxFromContext, whose writes a released error rolls back"

// effectProblems says what is wrong with n effects of c, answered ref: a
// success makes one, an error none. released are the attempts whose error
// a later attempt ran past.
func (c *call) effectProblems(ref Try, n int, released map[int]bool) []string {
	switch {
	case !ref.Failed && n > 1:
		msg := fmt.Sprintf("one key, %d effects: the operation took effect more than once, since the handler ran again after a run that had made its effect. ", n)
		switch {
		case c.rolledBackByKit():
			msg += "The first attempt's transaction rolled back (the kit's server half ends it as a server that dies before its commit does), yet its effect stayed: in atomic mode the handler writes outside the call's transaction, through the pool or another connection. Write through the transaction of postgres.TxFromContext(ctx), not through the pool, so that its writes commit with the call's record or not at all (an effect in another system needs two-phase mode)"
		case len(released) > 0:
			i := -1
			for j := range released {
				if i < 0 || j < i {
					i = j
				}
			}
			msg += fmt.Sprintf("Attempt %d answered %s, an error that idemkey releases rather than records, after the handler had made its effect, so the retry made it again. %s", i+1, c.attempts[i].Code, releasedFix)
		case c.failedRun() != "":
			msg += fmt.Sprintf("The handler answered %s for this key after making its effect (the kit's server half saw it), an error that idemkey releases rather than records, so a retry (the client's, or gRPC's retry policy) ran it again. %s", c.failedRun(), releasedFix)
		case c.cut:
			msg += "The attempt cut short in its handler (Chaos.Cancel) made its effect and then answered an error that idemkey releases (the cancellation, or one of its own), which freed the key, so the retry made the effect again. " + releasedFix
		default:
			msg += "A run made its effect and then answered an error that idemkey releases rather than records (Unavailable, Aborted, ResourceExhausted, a cancellation or deadline, ...), which frees the key, so a retry (the client's, or gRPC's retry policy, which the Kit does not see) ran it again. " + releasedFix
		}
		return []string{msg}
	case ref.Failed && n > 0:
		return []string{fmt.Sprintf("the call answered %s, yet left %d effect(s): a side effect before an error. A recorded error tells every retry the operation failed while its effect stands, and a released one lets a retry make it again. In two-phase mode, answer success once the effect is made (or undo it before failing); in atomic mode, write through postgres.TxFromContext, whose writes an error rolls back", ref.Code, n)}
	}
	return nil
}

// rolledBackByKit reports whether the server half rolled back the
// transaction of c's first attempt.
func (c *call) rolledBackByKit() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rolledBack
}

// runCodes are the codes the handler answered for c's key, as the server
// half saw them.
func (c *call) runCodes() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.runs)
}

// failedRun is the first code other than OK that the handler answered for
// c's key, as the server half saw it; "" if none.
func (c *call) failedRun() string {
	for _, code := range c.runCodes() {
		if !strings.HasPrefix(code, okRun) {
			return code
		}
	}
	return ""
}
