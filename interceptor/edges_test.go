package interceptor_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/engine"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/logtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/storetest"
)

// leaseStore is a store that keeps the lease of every reservation it is
// asked for.
type leaseStore struct {
	store.Store
	mu     sync.Mutex
	leases []time.Duration
}

func (s *leaseStore) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	s.mu.Lock()
	s.leases = append(s.leases, r.Lease)
	s.mu.Unlock()
	return s.Store.Reserve(ctx, r)
}

// count is how many reservations the store was asked for, and the lease of
// the last one.
func (s *leaseStore) count() (int, time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.leases) == 0 {
		return 0, 0
	}
	return len(s.leases), s.leases[len(s.leases)-1]
}

// rawCall sends one CreateCharge over HTTP/2 with the given headers, as a
// gRPC client would, and returns the grpc-status the server answered, or
// DeadlineExceeded if the server reset the stream (as grpc-go does once the
// deadline has passed). grpc-go's own client cannot send an arbitrary
// grpc-timeout, such as 99999999H.
func rawCall(t *testing.T, lis *bufconn.Listener, headers map[string]string, req proto.Message) codes.Code {
	t.Helper()
	msg, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	body := binary.BigEndian.AppendUint32([]byte{0}, uint32(len(msg)))
	body = append(body, msg...)
	tr := &http.Transport{Protocols: new(http.Protocols), DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return lis.DialContext(ctx)
	}}
	tr.Protocols.SetUnencryptedHTTP2(true)
	defer tr.CloseIdleConnections()
	hreq, err := http.NewRequest(http.MethodPost, "http://bufnet"+createCharge, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	hreq.Header.Set("content-type", "application/grpc")
	hreq.Header.Set("te", "trailers")
	for k, v := range headers {
		hreq.Header.Set(k, v)
	}
	resp, err := (&http.Client{Transport: tr, Timeout: 30 * time.Second}).Do(hreq)
	if err != nil {
		if strings.Contains(err.Error(), "CANCEL") {
			return codes.DeadlineExceeded
		}
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		if strings.Contains(err.Error(), "CANCEL") {
			return codes.DeadlineExceeded
		}
		t.Fatal(err)
	}
	grpcStatus := resp.Trailer.Get("grpc-status")
	if grpcStatus == "" { // a trailers-only answer
		grpcStatus = resp.Header.Get("grpc-status")
	}
	code, err := strconv.Atoi(grpcStatus)
	if err != nil {
		t.Fatalf("no grpc-status in the answer (HTTP %d): %q", resp.StatusCode, grpcStatus)
	}
	return codes.Code(code)
}

// TestLeaseOfEveryGRPCTimeout sends grpc-timeout values across the whole range
// the protocol allows (1n to 99999999H) and checks the lease the store is
// given: never negative or wrapped, never above the maximum, and the maximum
// for every timeout beyond it.
func TestLeaseOfEveryGRPCTimeout(t *testing.T) {
	st := &leaseStore{Store: memory.New()}
	svc := newService()
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(st, engine.WithTenant(tenantFromMetadata))))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	lis := grpctest.Serve(t, srv)

	units := map[byte]time.Duration{'n': time.Nanosecond, 'u': time.Microsecond, 'm': time.Millisecond, 'S': time.Second, 'M': time.Minute, 'H': time.Hour}
	for _, value := range []int64{1, 999, 300000, 2562047, 2562048, 99999999} {
		for unit, size := range units {
			timeout := strconv.FormatInt(value, 10) + string(unit)
			before, _ := st.count()
			rawCall(t, lis, map[string]string{"grpc-timeout": timeout, idemkey.KeyMetadata: idemkey.NewKey(), "tenant": "acme"}, request(1))
			after, lease := st.count()
			if after == before {
				if float64(value)*float64(size) >= float64(time.Second) {
					t.Fatalf("grpc-timeout %s: the store was asked for no reservation", timeout)
				}
				continue // the deadline passed before the interceptor ran
			}
			if lease <= 0 || lease > engine.DefaultMaxLease {
				t.Fatalf("grpc-timeout %s: the store got a lease of %v, want one in (0, %v]", timeout, lease, engine.DefaultMaxLease)
			}
			if d := float64(value) * float64(size); d >= float64(engine.DefaultMaxLease) && lease != engine.DefaultMaxLease {
				t.Errorf("grpc-timeout %s: lease %v, want the maximum %v", timeout, lease, engine.DefaultMaxLease)
			}
		}
	}
}

// TestLongestDeadlineHoldsTheKey is the attack that found the wrapped lease: a
// first call with the longest deadline a client can set, and a duplicate
// while it runs, on a raw grpc-timeout and on grpc-go's own client. The
// duplicate must not run the handler.
func TestLongestDeadlineHoldsTheKey(t *testing.T) {
	for _, via := range []string{"grpc-go", "raw 99999999H"} {
		t.Run(via, func(t *testing.T) {
			e := newE2E(t, engine.WithInProgressWait(0))
			started, release := e.svc.block()
			key := idemkey.NewKey()
			first := make(chan error, 1)
			go func() {
				ctx, cancel := context.WithTimeout(withKey(context.Background(), key), math.MaxInt64)
				defer cancel()
				_, err := e.plain.CreateCharge(ctx, request(1))
				first <- err
			}()
			waitFor(t, started, "the first call")
			ctx, cancel := context.WithTimeout(withKey(context.Background(), key), math.MaxInt64)
			defer cancel()
			var code codes.Code
			if via == "grpc-go" {
				_, err := e.plain.CreateCharge(ctx, request(1))
				code = status.Code(err)
			} else {
				code = rawCall(t, e.lis, map[string]string{"grpc-timeout": "99999999H", idemkey.KeyMetadata: key, "tenant": "acme"}, request(1))
			}
			close(release)
			if err := <-first; err != nil {
				t.Fatalf("first call: %v", err)
			}
			if code != codes.Aborted {
				t.Errorf("duplicate: %v, want Aborted (in progress)", code)
			}
			wantRuns(t, e.svc, 1)
		})
	}
}

// A full store refuses new keys with ResourceExhausted, reason
// IDEMPOTENCY_STORE_FULL and a RetryInfo, without running the handler, while
// recorded keys keep replaying; a key it lets in records its reply whole, up
// to WithMaxRecordSize, however little room is left. (A store that sets no
// room aside, and refuses the reply, is internal/adaptertest's case.)
func TestStoreFull(t *testing.T) {
	const maxRecord = 8 << 10
	// Room for the first small record and one of maxRecord, not two.
	st := memory.New(memory.WithMaxBytes(2*maxRecord), memory.WithTenantShare(1))
	d := &direct{intercept: grpctest.Interceptor(st, engine.WithTenant(tenantFromMetadata), engine.WithMaxRecordSize(maxRecord)), store: st, svc: newService()}
	first, _, err := d.create(t, "key-1", request(1))
	if err != nil {
		t.Fatal(err)
	}
	d.svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		return &paymentsv1.Charge{Id: "ch_big", Description: strings.Repeat("x", maxRecord-512)}, nil
	}
	big, _, err := d.create(t, "key-2", request(2))
	if err != nil || big.GetId() != "ch_big" {
		t.Fatalf("a large reply to a key the store let in: %v, %v; want it whole", big, err)
	}
	replay, ts, err := d.create(t, "key-2", request(2))
	if err != nil || !proto.Equal(replay, big) || !idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)) {
		t.Fatalf("retry of the large reply: %v (replayed %v), want it replayed whole", err, idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)))
	}
	_, _, err = d.create(t, "key-3", request(3))
	wantReason(t, err, codes.ResourceExhausted, idemkey.ReasonStoreFull)
	if delay, ok := idemkey.RetryDelay(err); !ok || delay != engine.DefaultMaxRetryAfter {
		t.Errorf("RetryInfo = %v, %v; want %v", delay, ok, engine.DefaultMaxRetryAfter)
	}
	replay, ts, err = d.create(t, "key-1", request(1))
	if err != nil || !proto.Equal(replay, first) || !idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)) {
		t.Errorf("replay in a full store: %v, %v; want %v, replayed", replay, err, first)
	}
	wantRuns(t, d.svc, 2)
}

// A flood of large replies into a bounded memory store: 150 concurrent calls
// with 1 MiB replies against a bound of 32 MiB. Each call either runs and gets
// its real reply, which its retry replays, or is refused with
// ResourceExhausted (IDEMPOTENCY_STORE_FULL) before the handler runs; none
// runs and then answers Internal for want of room. And once one tenant has
// filled its share, another tenant's new key still runs.
func TestStoreFullFloodOfLargeReplies(t *testing.T) {
	const (
		calls     = 150
		replySize = 1 << 20
		maxBytes  = 32 << 20
	)
	reply := strings.Repeat("x", replySize)
	var runs atomic.Int32
	svc := newService()
	svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		runs.Add(1)
		return &paymentsv1.Charge{Id: "ch_" + strconv.FormatInt(req.GetAmount(), 10), Amount: req.GetAmount(), Description: reply}, nil
	}
	st := memory.New(memory.WithMaxBytes(maxBytes))
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(grpctest.Interceptor(st,
		engine.WithTenant(tenantFromMetadata), engine.WithLogger(nil))))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv), grpc.WithDisableRetry()))
	create := func(tenant, key string, amount int64) (*paymentsv1.Charge, bool, error) {
		ctx := metadata.AppendToOutgoingContext(t.Context(), idemkey.KeyMetadata, key, "tenant", tenant)
		var trailer metadata.MD
		charge, err := client.CreateCharge(ctx, request(amount), grpc.Trailer(&trailer))
		return charge, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), err
	}
	// refused reports whether err is the store's refusal; any other error
	// fails the test.
	refused := func(what string, err error) bool {
		t.Helper()
		if status.Code(err) == codes.ResourceExhausted && idemkey.Reason(err) == idemkey.ReasonStoreFull {
			return true
		}
		t.Errorf("%s: %v; want its reply or ResourceExhausted (%s)", what, err, idemkey.ReasonStoreFull)
		return false
	}

	var (
		wg    sync.WaitGroup
		start = make(chan struct{})
		errs  = make([]error, calls)
	)
	for i := range calls {
		wg.Go(func() {
			<-start
			charge, _, err := create("acme", "flood-"+strconv.Itoa(i), int64(i+1))
			if err == nil && (charge.GetAmount() != int64(i+1) || len(charge.GetDescription()) != replySize) {
				t.Errorf("call %d answered OK with another reply (amount %d, %d bytes)", i, charge.GetAmount(), len(charge.GetDescription()))
			}
			errs[i] = err
		})
	}
	close(start)
	wg.Wait()
	var ok, full int
	for i, err := range errs {
		switch {
		case err == nil:
			ok++
			// Its retry replays the reply, whole, without running again.
			charge, replayed, err := create("acme", "flood-"+strconv.Itoa(i), int64(i+1))
			if err != nil || !replayed || charge.GetAmount() != int64(i+1) || len(charge.GetDescription()) != replySize {
				t.Errorf("retry of call %d: %v (replayed %v, %d bytes); want its reply replayed", i, err, replayed, len(charge.GetDescription()))
			}
		case refused("call "+strconv.Itoa(i), err):
			full++
		}
	}
	t.Logf("%d concurrent calls with %d KiB replies into %d MiB: %d ran, %d refused", calls, replySize>>10, maxBytes>>20, ok, full)
	if ok == 0 {
		t.Error("no call ran")
	}
	if n := int(runs.Load()); n != ok {
		t.Errorf("the handler ran %d times for %d calls answered OK: a refused call ran", n, ok)
	}

	// acme fills its share with new keys, one after the other.
	filled := false
	for i := range maxBytes / replySize {
		_, _, err := create("acme", "fill-"+strconv.Itoa(i), int64(calls+i+1))
		if err != nil {
			filled = refused("acme filling its share", err)
			break
		}
	}
	if !filled {
		t.Fatal("acme's new keys were never refused")
	}
	before := runs.Load()
	charge, _, err := create("globex", "globex-1", 1)
	if err != nil || len(charge.GetDescription()) != replySize {
		t.Errorf("globex's new key once acme is refused: %v; want it to run", err)
	}
	if runs.Load() != before+1 {
		t.Error("globex's call did not run")
	}
}

// flakyStore fails the first few Completes, as a store whose connection
// died does.
type flakyStore struct {
	store.Store
	failures atomic.Int32 // how many Completes are still to fail
}

func (s *flakyStore) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
	if s.failures.Add(-1) >= 0 {
		return errDown
	}
	return s.Store.Complete(ctx, key, token, outcome)
}

// A record that cannot be written at once is written in the background
// before the lease ends, so a retry after the lease replays the reply instead
// of running the handler again.
func TestCompleteRetriedInTheBackground(t *testing.T) {
	clock := storetest.NewClock()
	st := &flakyStore{Store: memory.New(memory.WithClock(clock.Now))}
	st.failures.Store(3)
	svc := newService()
	logger, logs := logtest.New()
	intercept := grpctest.Interceptor(st, engine.WithLease(2*time.Second), engine.WithMaxLease(2*time.Second), engine.WithLogger(logger))
	d := &direct{intercept: intercept, svc: svc}
	first, _, err := d.create(t, "key-1", request(1))
	if err != nil {
		t.Fatalf("first call: %v", err)
	}
	for deadline := time.Now().Add(2 * time.Second); st.failures.Load() >= 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the record was not retried")
		}
	}
	clock.Advance(t, 3*time.Second) // the lease has ended
	replay, ts, err := d.create(t, "key-1", request(1))
	if err != nil || !proto.Equal(replay, first) || !idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)) {
		t.Fatalf("retry after the lease: %v, %v (replayed %v); want the first reply, replayed", replay, err, idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)))
	}
	wantRuns(t, svc, 1)
	// The goroutine logs once its write has returned, which may be after
	// the replay above.
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(logs.String(), "complete succeeded in the background"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the background record was not logged:\n%s", logs.String())
		}
	}
}
