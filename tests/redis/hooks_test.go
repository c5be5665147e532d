package redis_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/logtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/redis"
	"github.com/idemkey/idemkey/tests/redistest"
)

// hookLog is an application's hooks: it keeps each event as "hook verdict
// code tenant/key size", and then panics if told to.
type hookLog struct {
	mu     sync.Mutex
	events []string
	panics atomic.Bool
}

func (h *hookLog) hooks() engine.Hooks {
	keep := func(hook string) func(context.Context, engine.Event) {
		return func(_ context.Context, ev engine.Event) {
			h.mu.Lock()
			h.events = append(h.events, fmt.Sprintf("%s %s %d %s/%s %d", hook, ev.Verdict, ev.Code, ev.Tenant, ev.Key, ev.Size))
			h.mu.Unlock()
			if h.panics.Load() {
				panic("audit failed for " + ev.Key)
			}
		}
	}
	return engine.Hooks{OnExecute: keep("execute"), OnReplay: keep("replay"), OnRefuse: keep("refuse")}
}

// want checks the events since the last check; size stands for the size
// of the record, which the first event must have.
func (h *hookLog) want(t *testing.T, want ...string) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	var size string
	if len(h.events) > 0 {
		f := strings.Fields(h.events[0])
		size = f[len(f)-1]
	}
	for i := range want {
		want[i] = strings.ReplaceAll(want[i], "SIZE", size)
	}
	if size == "0" || strings.Join(h.events, "\n") != strings.Join(want, "\n") {
		t.Errorf("hooks ran:\n\t%s\nwant (with a record of more than 0 bytes):\n\t%s", strings.Join(h.events, "\n\t"), strings.Join(want, "\n\t"))
	}
	h.events = nil
}

func hooksStore(t *testing.T) store.Store {
	st, err := redis.New(t.Context(), redistest.Client(t), redis.WithPrefix(prefix()))
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestHooks: on Redis, every entry point reports one execution for a key
// sent four times, and three replays of a record of the same size, then a
// refusal for the key reused with another request; a panicking hook
// changes no answer, and is logged without the key.
func TestHooks(t *testing.T) {
	t.Run("grpc", func(t *testing.T) {
		var hooks hookLog
		logger, logs := logtest.New()
		eng := grpctest.Must(engine.New(hooksStore(t),
			engine.WithTenant(func(context.Context) (string, error) { return "acme", nil }),
			engine.WithLogger(logger), engine.WithHooks(hooks.hooks())))
		srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Must(interceptor.UnaryServerInterceptor(eng))))
		svc := &chargeLedger{charges: map[string]int{}}
		paymentsv1.RegisterPaymentServiceServer(srv, svc)
		payments := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv), grpc.WithDisableRetry()))
		send := func(key string, amount int64) (string, error) {
			ctx := metadata.AppendToOutgoingContext(t.Context(), idemkey.KeyMetadata, key)
			c, err := payments.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: amount, Currency: "EUR"})
			return c.GetId(), err
		}
		for _, panics := range []bool{false, true} {
			hooks.panics.Store(panics)
			key := fmt.Sprint("key-secret-", panics)
			first, err := send(key, 100)
			for range 3 {
				if id, err2 := send(key, 100); err != nil || err2 != nil || id != first {
					t.Fatalf("panicking hook %v: replies %q (%v) then %q (%v), want one charge", panics, first, err, id, err2)
				}
			}
			if _, err := send(key, 200); idemkey.Reason(err) != idemkey.ReasonKeyReused {
				t.Fatalf("reused key: %v, want %s", err, idemkey.ReasonKeyReused)
			}
			hooks.want(t,
				"execute executed 0 acme/"+key+" SIZE",
				"replay replayed 0 acme/"+key+" SIZE", "replay replayed 0 acme/"+key+" SIZE", "replay replayed 0 acme/"+key+" SIZE",
				"refuse reused 3 acme/"+key+" 0")
		}
		if n := svc.count("cus_1"); n != 2 {
			t.Errorf("%d charges, want one per key", n)
		}
		wantErrorLine(t, "interceptor", logs, []string{"OnReplay hook panicked"}, "key-secret")
	})

	t.Run("http", func(t *testing.T) {
		var hooks hookLog
		logger, logs := logtest.New()
		eng := grpctest.Must(engine.New(hooksStore(t), engine.WithLogger(logger), engine.WithHooks(hooks.hooks()),
			engine.WithTenant(func(context.Context) (string, error) { return "acme", nil })))
		mw, err := idemhttp.Middleware(eng)
		if err != nil {
			t.Fatal(err)
		}
		var runs atomic.Int32
		mux := http.NewServeMux()
		mux.Handle("POST /v1/charges", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "ch_%d", runs.Add(1))
		})))
		srv := httptest.NewServer(mux)
		t.Cleanup(srv.Close)
		send := func(key, body string) (int, string) {
			req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/v1/charges", bytes.NewBufferString(body))
			req.Header.Set(idemkey.KeyHeader, key)
			resp, err := srv.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			got, err := io.ReadAll(resp.Body)
			if err != nil {
				t.Fatal(err)
			}
			return resp.StatusCode, string(got)
		}
		for _, panics := range []bool{false, true} {
			hooks.panics.Store(panics)
			key := fmt.Sprint("key-secret-", panics)
			status, first := send(key, "amount=100")
			for range 3 {
				if s, body := send(key, "amount=100"); status != http.StatusCreated || s != status || body != first {
					t.Fatalf("panicking hook %v: %d %q then %d %q, want one charge", panics, status, first, s, body)
				}
			}
			if s, _ := send(key, "amount=200"); s != http.StatusUnprocessableEntity {
				t.Fatalf("reused key: %d, want 422", s)
			}
			hooks.want(t,
				"execute executed 201 acme/"+key+" SIZE",
				"replay replayed 201 acme/"+key+" SIZE", "replay replayed 201 acme/"+key+" SIZE", "replay replayed 201 acme/"+key+" SIZE",
				"refuse reused 422 acme/"+key+" 0")
		}
		if n := runs.Load(); n != 2 {
			t.Errorf("the handler ran %d times, want once per key", n)
		}
		wantErrorLine(t, "middleware", logs, []string{"OnReplay hook panicked"}, "key-secret")
	})

	t.Run("consumer", func(t *testing.T) {
		var hooks hookLog
		logger, logs := logtest.New()
		eng := grpctest.Must(engine.New(hooksStore(t), engine.WithLogger(logger), engine.WithHooks(hooks.hooks())))
		var runs atomic.Int32
		handler := func(context.Context, consumer.Delivery) error { runs.Add(1); return nil }
		c, err := consumer.New(eng, "charges", deliveryBroker{}, handler,
			consumer.WithMessageTenant(func(d consumer.Delivery) (string, error) { return d.Tenant, nil }),
			consumer.WithDeadLetter(func(context.Context, consumer.Delivery, error) error { return nil }))
		if err != nil {
			t.Fatal(err)
		}
		for _, panics := range []bool{false, true} {
			hooks.panics.Store(panics)
			id := fmt.Sprint("key-secret-", panics)
			for i, want := range []consumer.Outcome{consumer.Processed, consumer.Duplicate, consumer.Duplicate, consumer.Duplicate} {
				d := consumer.Delivery{ID: id, Tenant: "acme", Body: []byte("charge 100"), Attempt: i + 1, Redelivered: i > 0}
				if res := c.Handle(t.Context(), d); res.Outcome != want || res.Action != consumer.Ack {
					t.Fatalf("panicking hook %v, delivery %d: %v, want %v", panics, i+1, res, want)
				}
			}
			reused := consumer.Delivery{ID: id, Tenant: "acme", Body: []byte("charge 200"), Attempt: 1}
			if res := c.Handle(t.Context(), reused); res.Outcome != consumer.Rejected {
				t.Fatalf("reused id: %v, want refused", res)
			}
			ack, reject := int(consumer.Ack), int(consumer.Reject)
			hooks.want(t,
				fmt.Sprintf("execute executed %d acme/%s SIZE", ack, id),
				fmt.Sprintf("replay replayed %d acme/%s SIZE", ack, id), fmt.Sprintf("replay replayed %d acme/%s SIZE", ack, id),
				fmt.Sprintf("replay replayed %d acme/%s SIZE", ack, id),
				fmt.Sprintf("refuse reused %d acme/%s 0", reject, id))
		}
		if n := runs.Load(); n != 2 {
			t.Errorf("the handler ran %d times, want once per message", n)
		}
		wantErrorLine(t, "consumer", logs, []string{"OnReplay hook panicked"}, "key-secret")
	})
}

// deliveryBroker is a consumer.Broker whose messages are the deliveries
// themselves, as a broker would read them, and which settles nothing: the
// test reads each Result.
type deliveryBroker struct{}

func (deliveryBroker) System() string                                      { return "test" }
func (deliveryBroker) ID(d consumer.Delivery) (string, error)              { return d.ID, nil }
func (deliveryBroker) Read(d consumer.Delivery) (consumer.Delivery, error) { return d, nil }
func (deliveryBroker) Settle(context.Context, []consumer.Delivery, []consumer.Result) error {
	return nil
}
func (deliveryBroker) Horizons(time.Duration) []consumer.Horizon { return nil }
