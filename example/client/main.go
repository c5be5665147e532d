// Command client walks through what idemkey does for the example payment
// service, printing each call and its answer. It checks every answer and
// exits non-zero if one is not what idemkey promises.
//
//	go run ./example/client [-addr 127.0.0.1:50051] [-api-key sk_test_acme] [-wait 10s] [-metrics-url URL]
//
// Start the server with a handler delay (make demo uses 1.5s) to see a
// duplicate arrive while the first call is still running. Each run uses
// customers and a merchant_reference of its own, so the demo passes any
// number of times against a server on PostgreSQL, whose charges outlive it.
//
// With -metrics-url (the server's -metrics-addr, as http://ADDR/metrics), it
// ends by printing the server's idemkey_calls_total counters: how many calls
// the server counted for each idemkey outcome and status code.
package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:50051", "address of the example server")
	apiKey := flag.String("api-key", "sk_test_acme", "API key that names the tenant")
	wait := flag.Duration("wait", 10*time.Second, "how long to wait for the server to be ready")
	metricsURL := flag.String("metrics-url", "", "if set, the server's Prometheus metrics (http://ADDR/metrics): print idemkey's call counters at the end")
	flag.Parse()
	if err := run(context.Background(), *addr, *apiKey, *wait, *metricsURL, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, addr, apiKey string, wait time.Duration, metricsURL string, out io.Writer) error {
	// The client every service should use: keys attached once per call, and
	// the retry policy of the example's service config below them.
	keys, err := interceptor.UnaryClientInterceptor()
	if err != nil {
		return err
	}
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(example.ServiceConfig),
		grpc.WithUnaryInterceptor(keys),
		grpc.WithStatsHandler(attempts{}))
	if err != nil {
		return err
	}
	defer conn.Close()
	// A client that does not use idemkey, to show what the server refuses.
	bare, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer bare.Close()

	ready, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	if _, err := healthpb.NewHealthClient(conn).Check(ready, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true)); err != nil {
		return fmt.Errorf("server at %s not ready: %w", addr, err)
	}
	fmt.Fprintf(out, "idemkey demo against the payment service at %s\n", addr)

	run := strings.ToLower(rand.Text()[:6])
	d := &demo{
		out:    out,
		client: paymentsv1.NewPaymentServiceClient(conn),
		bare:   paymentsv1.NewPaymentServiceClient(bare),
		ctx:    metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+apiKey),
		alice: &paymentsv1.CreateChargeRequest{
			CustomerId:        "cus_alice_" + run,
			Amount:            1999,
			Currency:          "EUR",
			Description:       "Annual plan",
			MerchantReference: "order-" + run,
		},
		bob: "cus_bob_" + run,
	}
	for _, scene := range []func() error{d.create, d.retry, d.reuse, d.noKey, d.duplicate, d.declined, d.sameReference, d.count} {
		if err := scene(); err != nil {
			return err
		}
	}
	if metricsURL == "" {
		return nil
	}
	return printCalls(ctx, metricsURL, out)
}

// callsMetric is the Prometheus name of idemkey's idemkey.calls counter.
const callsMetric = "idemkey_calls_total"

// printCalls fetches the server's metrics from url and prints its
// idemkey_calls_total counters as a table, a row per outcome and status code
// (summed over methods), ordered by outcome and code.
func printCalls(ctx context.Context, url string, out io.Writer) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	req.Close = true // one request: keep no idle connection behind
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("metrics: GET %s: %s", url, resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return fmt.Errorf("metrics: %s: %w", url, err)
	}
	type row struct {
		outcome string
		code    codes.Code
	}
	counts := map[row]float64{}
	for _, m := range families[callsMetric].GetMetric() {
		var r row
		for _, l := range m.GetLabel() {
			switch l.GetName() {
			case "idemkey_outcome":
				r.outcome = l.GetValue()
			case "rpc_response_status_code": // the canonical name, such as INVALID_ARGUMENT
				n, ok := rpccode.Code_value[l.GetValue()]
				if !ok {
					return fmt.Errorf("metrics: %s: status code %q", callsMetric, l.GetValue())
				}
				r.code = codes.Code(n)
			}
		}
		counts[r] += m.GetCounter().GetValue()
	}
	if len(counts) == 0 {
		return fmt.Errorf("metrics: no %s at %s", callsMetric, url)
	}
	rows := slices.SortedFunc(maps.Keys(counts), func(a, b row) int {
		return cmp.Or(strings.Compare(a.outcome, b.outcome), cmp.Compare(a.code, b.code))
	})
	fmt.Fprintf(out, "\nThe server counted these calls (%s at %s):\n", callsMetric, url)
	w := tabwriter.NewWriter(out, 0, 0, 3, ' ', 0)
	fmt.Fprintln(w, "   outcome\tcode\tcalls")
	for _, r := range rows {
		fmt.Fprintf(w, "   %s\t%v\t%g\n", r.outcome, r.code, counts[r])
	}
	return w.Flush()
}

type demo struct {
	out          io.Writer
	client, bare paymentsv1.PaymentServiceClient
	ctx          context.Context

	// This run's first charge, and the customer of its duplicate: their
	// names end in a random run id.
	alice *paymentsv1.CreateChargeRequest
	bob   string

	key     string // of the first charge
	charge  *paymentsv1.Charge
	expires time.Time // until when the server honours key
	scene   int
}

func (d *demo) say(format string, args ...any) {
	fmt.Fprintf(d.out, format+"\n", args...)
}

func (d *demo) title(s string) {
	d.scene++
	d.say("\n%d. %s", d.scene, s)
}

// call makes one CreateCharge call and returns its trailer with the result.
func (d *demo) call(ctx context.Context, client paymentsv1.PaymentServiceClient, req *paymentsv1.CreateChargeRequest, opts ...grpc.CallOption) (*paymentsv1.Charge, metadata.MD, error) {
	var trailer metadata.MD
	charge, err := client.CreateCharge(ctx, req, append(opts, grpc.Trailer(&trailer))...)
	return charge, trailer, err
}

func (d *demo) create() error {
	d.key = idemkey.NewKey()
	d.title(fmt.Sprintf("Create a charge of 19.99 EUR for %s, merchant_reference %s, idempotency key %s",
		d.alice.GetCustomerId(), d.alice.GetMerchantReference(), d.key))
	charge, trailer, err := d.call(d.ctx, d.client, d.alice, interceptor.UseKey(d.key), interceptor.KeyExpiry(&d.expires))
	if err != nil {
		return fmt.Errorf("create: %w", err)
	}
	d.charge = charge
	d.say("   -> OK: charge %s created%s", charge.GetId(), replayedNote(trailer))
	d.say("   the key is honoured until %s [%s]: a retry before then is answered from its record", expiresNote(d.expires), idemkey.ExpiresMetadata)
	if err := expect(!d.expires.IsZero(), "the reply did not tell the key's expiry"); err != nil {
		return err
	}
	return expect(!idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), "the first reply is marked replayed")
}

func (d *demo) retry() error {
	d.title("The reply was lost on the way; the client retries with the same key")
	var expires time.Time
	charge, trailer, err := d.call(d.ctx, d.client, d.alice, interceptor.UseKey(d.key), interceptor.KeyExpiry(&expires))
	if err != nil {
		return fmt.Errorf("retry: %w", err)
	}
	d.say("   -> OK: charge %s, the same charge%s; no second charge was made", charge.GetId(), replayedNote(trailer))
	d.say("   the key is still honoured until %s, the same instant", expiresNote(expires))
	if err := expect(expires.Equal(d.expires), "the replay told another expiry than the first reply"); err != nil {
		return err
	}
	return expect(charge.GetId() == d.charge.GetId() && idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), "the retry was not a replay of the first charge")
}

func (d *demo) reuse() error {
	d.title("The same key with a different amount (25.00 instead of 19.99)")
	changed := clone(d.alice)
	changed.Amount = 2500
	_, _, err := d.call(d.ctx, d.client, changed, interceptor.UseKey(d.key))
	d.say("   -> %s", describe(err))
	return expectReason(err, codes.InvalidArgument, idemkey.ReasonKeyReused)
}

func (d *demo) noKey() error {
	d.title("A client without the idemkey interceptor sends no key")
	_, _, err := d.call(d.ctx, d.bare, clone(d.alice))
	d.say("   -> %s", describe(err))
	return expectReason(err, codes.InvalidArgument, idemkey.ReasonKeyMissing)
}

func (d *demo) duplicate() error {
	d.title("A duplicate is sent while the first call is still running")
	req := &paymentsv1.CreateChargeRequest{CustomerId: d.bob, Amount: 500, Currency: "USD", Description: "Coffee beans"}
	key := idemkey.NewKey()
	type result struct {
		charge  *paymentsv1.Charge
		trailer metadata.MD
		err     error
	}
	send := func(ctx context.Context) <-chan result {
		ch := make(chan result, 1)
		go func() {
			var r result
			r.charge, r.trailer, r.err = d.call(ctx, d.client, req, interceptor.UseKey(key))
			ch <- r
		}()
		return ch
	}
	firstTrace, dupTrace := &trace{}, &trace{}
	first := send(context.WithValue(d.ctx, traceKey{}, firstTrace))
	time.Sleep(200 * time.Millisecond)
	dup := send(context.WithValue(d.ctx, traceKey{}, dupTrace))
	a, b := <-first, <-dup
	if a.err != nil || b.err != nil {
		return fmt.Errorf("duplicate: first %v, duplicate %v", a.err, b.err)
	}
	d.say("   first call:  %s", strings.Join(firstTrace.lines(), "; "))
	for i, line := range dupTrace.lines() {
		d.say("   duplicate, attempt %d: %s", i+1, line)
	}
	// The narration follows what the traces show.
	switch id := b.charge.GetId(); {
	case len(dupTrace.lines()) == 1 && idemkey.ParseReplayed(b.trailer.Get(idemkey.ReplayedMetadata)):
		d.say("   -> the server held the duplicate until the first call finished, then replayed its charge %s", id)
	case len(dupTrace.lines()) > 1:
		d.say("   -> both calls got charge %s: the server answered the duplicate Aborted while the first call ran, and gRPC's retry policy resent the same key until it finished", id)
	default:
		d.say("   -> both calls got charge %s", id)
	}
	return expect(a.charge.GetId() == b.charge.GetId(), "the duplicate got a different charge")
}

func (d *demo) declined() error {
	d.title("A declined card is recorded, and its retry replays the decline")
	req := &paymentsv1.CreateChargeRequest{CustomerId: example.DeclinedCustomer, Amount: 4200, Currency: "EUR"}
	key := idemkey.NewKey()
	_, _, first := d.call(d.ctx, d.client, req, interceptor.UseKey(key))
	d.say("   -> %s", describe(first))
	_, trailer, retry := d.call(d.ctx, d.client, req, interceptor.UseKey(key))
	d.say("   retry -> %s%s; the card was not tried again", describe(retry), replayedNote(trailer))
	if err := expectReason(first, codes.FailedPrecondition, ""); err != nil {
		return err
	}
	return expect(status.Code(retry) == codes.FailedPrecondition && idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), "the decline was not replayed")
}

func (d *demo) sameReference() error {
	d.title("A new key, but the merchant_reference of the first charge (the business-level second line of defence)")
	_, _, err := d.call(d.ctx, d.client, clone(d.alice))
	d.say("   -> %s", describe(err))
	return expectReason(err, codes.AlreadyExists, "")
}

func (d *demo) count() error {
	d.say("")
	for _, customer := range []string{d.alice.GetCustomerId(), d.bob} {
		n, err := d.countCharges(customer)
		if err != nil {
			return err
		}
		d.say("%s has %d charge(s)", customer, n)
		if err := expect(n == 1, "a retry or duplicate charged twice"); err != nil {
			return err
		}
	}
	d.say("Every retry and duplicate was answered without charging twice.")
	return nil
}

// countCharges counts a customer's charges, page by page.
func (d *demo) countCharges(customer string) (int, error) {
	req := &paymentsv1.ListChargesRequest{CustomerId: customer}
	for n := 0; ; {
		resp, err := d.client.ListCharges(d.ctx, req)
		if err != nil {
			return 0, err
		}
		n += len(resp.GetCharges())
		if resp.GetNextPageToken() == "" {
			return n, nil
		}
		req.PageToken = resp.GetNextPageToken()
	}
}

func clone(req *paymentsv1.CreateChargeRequest) *paymentsv1.CreateChargeRequest {
	return proto.Clone(req).(*paymentsv1.CreateChargeRequest)
}

func replayedNote(trailer metadata.MD) string {
	if idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		return " [" + idemkey.ReplayedMetadata + ": true]"
	}
	return ""
}

// expiresNote renders a key's expiry as the server sent it (an HTTP date),
// or says that it sent none.
func expiresNote(t time.Time) string {
	if t.IsZero() {
		return "(the server did not say)"
	}
	return idemkey.FormatDate(t)
}

// describe renders an error as the user would read it: code, idemkey reason
// and message.
func describe(err error) string {
	st := status.Convert(err)
	if reason := idemkey.Reason(err); reason != "" {
		return fmt.Sprintf("%v %s: %s", st.Code(), reason, st.Message())
	}
	return fmt.Sprintf("%v: %s", st.Code(), st.Message())
}

func expect(ok bool, problem string) error {
	if !ok {
		return errors.New(problem)
	}
	return nil
}

func expectReason(err error, code codes.Code, reason string) error {
	if status.Code(err) != code || idemkey.Reason(err) != reason {
		return fmt.Errorf("got %v, want %v %s", err, code, reason)
	}
	return nil
}

// attempts is a stats handler that writes each attempt of a call into the
// trace in its context: gRPC retries below interceptors, so only a stats
// handler sees the attempts one by one.
type attempts struct{}

type traceKey struct{}

type trace struct {
	mu       sync.Mutex
	attempts []string
}

func (t *trace) add(s string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.attempts = append(t.attempts, s)
}

func (t *trace) lines() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.attempts
}

func (attempts) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context   { return ctx }
func (attempts) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (attempts) HandleConn(context.Context, stats.ConnStats)                       {}

func (attempts) HandleRPC(ctx context.Context, s stats.RPCStats) {
	end, ok := s.(*stats.End)
	tr, traced := ctx.Value(traceKey{}).(*trace)
	if !ok || !traced {
		return
	}
	line := "OK" + replayedNote(end.Trailer)
	if end.Error != nil {
		line = describe(end.Error)
		if p := end.Trailer.Get(interceptor.PushbackMetadata); len(p) == 1 {
			line += " (server pushback " + p[0] + "ms)"
		}
	}
	tr.add(line)
}
