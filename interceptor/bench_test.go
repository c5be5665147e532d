package interceptor_test

import (
	"bytes"
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/engine"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store/memory"
)

// BenchmarkUnary measures a CreateCharge call over bufconn three ways, so
// that `benchstat -col /call` shows the interceptor's cost beside the bare
// call: without the interceptor; a first call on the memory store (a fresh
// key each time); and a replay (one key, recorded once).
func BenchmarkUnary(b *testing.B) {
	b.Run("call=bare", func(b *testing.B) {
		benchmarkCalls(b, newBenchClient(b), func(i int) string { return "bare-" + strconv.Itoa(i) })
	})
	b.Run("call=first", func(b *testing.B) {
		client := newBenchClient(b, grpc.UnaryInterceptor(grpctest.Interceptor(memory.New())))
		benchmarkCalls(b, client, func(i int) string { return "first-" + strconv.Itoa(i) })
	})
	b.Run("call=replay", func(b *testing.B) {
		client := newBenchClient(b, grpc.UnaryInterceptor(grpctest.Interceptor(memory.New())))
		benchmarkCalls(b, client, func(int) string { return "replay" })
	})
}

// BenchmarkOverhead makes the same calls interleaved, one of each per
// iteration in rotating order, so that a noisy machine slows all alike: the
// bare call, a first call and a replay, and the floor of each (below). It
// reports each one's time, the first call's and the replay's ratio to the
// bare call's and the time and the allocations (counted apart, see
// benchtest.Allocs) they add to it, and the same against their floors.
func BenchmarkOverhead(b *testing.B) {
	bare := newBenchClient(b)
	// Room for every first call of a long run: the default bounds fill up
	// with the records of some 100,000 calls.
	st := memory.New(memory.WithMaxRecords(1<<30), memory.WithMaxBytes(1<<40))
	guarded := newBenchClient(b, grpc.UnaryInterceptor(grpctest.Interceptor(st)))
	req := request(1999)
	replay := metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, "replay")
	if _, err := guarded.CreateCharge(replay, req); err != nil {
		b.Fatal(err)
	}
	bareCtx := metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, "bare")
	call := func(c paymentsv1.PaymentServiceClient, ctx context.Context) error {
		_, err := c.CreateCharge(ctx, req)
		return err
	}
	var firsts int            // a new key for every first call, of Interleave's and Allocs' runs alike
	var first context.Context // its metadata, made before it is timed
	ops := []benchtest.Op{
		{Name: "bare", Run: func(int) error { return call(bare, bareCtx) }},
		{Name: "first", Run: func(int) error { return call(guarded, first) }, Before: func(int) {
			firsts++
			first = metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, "first-"+strconv.Itoa(firsts))
		}},
		{Name: "replay", Run: func(int) error { return call(guarded, replay) }},
	}
	// The floors: a server interceptor that does nothing but set the
	// trailers idemkey's first call and replay set, with a value of the
	// same length made once. What the first call and the replay add to them
	// is idemkey's own work; what they add to the bare call is grpc-go's, for
	// an interceptor and for its trailer fields, which its client reads.
	expires := idemkey.FormatDate(time.Now().Add(24 * time.Hour))
	floor := func(md metadata.MD) paymentsv1.PaymentServiceClient {
		return newBenchClient(b, grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			_ = grpc.SetTrailer(ctx, md)
			return handler(ctx, req)
		}))
	}
	firstFloor := floor(metadata.MD{idemkey.ExpiresMetadata: {expires}, idemkey.ReplayedMetadata: {"false"}})
	replayFloor := floor(metadata.MD{idemkey.ExpiresMetadata: {expires}, idemkey.ReplayedMetadata: {"true"}})
	ops = append(ops,
		benchtest.Op{Name: "first-floor", Run: func(int) error { return call(firstFloor, bareCtx) }},
		benchtest.Op{Name: "replay-floor", Run: func(int) error { return call(replayFloor, bareCtx) }})
	ns := benchtest.Interleave(b, ops...)
	allocs := benchtest.Allocs(b, 1000, ops...)
	benchtest.ReportAdded(b, ops[:3], ns, allocs)
	for _, pair := range [][2]int{{1, 3}, {2, 4}} {
		op, floor := ops[pair[0]].Name, ops[pair[1]].Name
		b.ReportMetric(ns[pair[0]]/ns[pair[1]], op+"/floor")
		b.ReportMetric((ns[pair[0]]-ns[pair[1]])/1e3, op+"-over-floor-µs")
		b.ReportMetric(allocs[pair[0]]-allocs[pair[1]], op+"-over-floor-allocs")
		b.ReportMetric(ns[pair[1]]/ns[0], floor+"/bare")
		b.ReportMetric(allocs[pair[1]]-allocs[0], floor+"-added-allocs")
	}
}

func benchmarkCalls(b *testing.B, client paymentsv1.PaymentServiceClient, key func(i int) string) {
	req := request(1999)
	ctxs := make([]context.Context, b.N)
	for i := range ctxs {
		ctxs[i] = metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, key(i))
	}
	// Warm up the connection and, for the replay, record the outcome.
	if _, err := client.CreateCharge(metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, "replay"), req); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := client.CreateCharge(ctxs[i], req); err != nil {
			b.Fatal(err)
		}
	}
}

func newBenchClient(b *testing.B, opts ...grpc.ServerOption) paymentsv1.PaymentServiceClient {
	b.Helper()
	srv := grpc.NewServer(opts...)
	svc := newService()
	svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		return &paymentsv1.Charge{Id: "ch_0123456789abcdef01234567", CustomerId: req.GetCustomerId(), Amount: req.GetAmount(), Currency: req.GetCurrency(),
			Description: req.GetDescription()}, nil
	}
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	return paymentsv1.NewPaymentServiceClient(grpctest.Dial(b, grpctest.Serve(b, srv)))
}

// BenchmarkTelemetry makes first calls through two interceptors interleaved:
// one with the default, global meter provider (a no-op until an SDK is
// installed), and one with OpenTelemetry's metrics SDK attached, and reports
// the ratio of their times.
func BenchmarkTelemetry(b *testing.B) {
	tm := newTelemetry()
	clients := [2]paymentsv1.PaymentServiceClient{
		newBenchClient(b, grpc.UnaryInterceptor(grpctest.Interceptor(memory.New()))),
		newBenchClient(b, grpc.UnaryInterceptor(grpctest.Interceptor(memory.New(), tm.options()...))),
	}
	req := request(1999)
	ctxs := make([]context.Context, b.N)
	for i := range ctxs {
		ctxs[i] = metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, "first-"+strconv.Itoa(i))
	}
	for _, c := range clients { // warm up the connections
		if _, err := c.CreateCharge(metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, "warm-up"), req); err != nil {
			b.Fatal(err)
		}
	}
	var spent [2]time.Duration // no-op, SDK
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := range 2 {
			path := (i + j) % 2
			start := time.Now()
			if _, err := clients[path].CreateCharge(ctxs[i], req); err != nil {
				b.Fatal(err)
			}
			spent[path] += time.Since(start)
		}
	}
	perCall := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / float64(b.N) }
	b.ReportMetric(perCall(spent[0]), "noop-ns/call")
	b.ReportMetric(perCall(spent[1]), "sdk-ns/call")
	b.ReportMetric(perCall(spent[1])/perCall(spent[0]), "sdk/noop")
}

// BenchmarkSealedCall measures what sealing costs a call whose reply is
// 1 KiB: first calls and replays over bufconn on the memory store, without
// and with a key ring (WithSealer), interleaved, so that noise hits both
// alike. It reports each one's time and the sealed call's ratio to the
// plain one: one Seal more for a first call, one Open for a replay.
func BenchmarkSealedCall(b *testing.B) {
	ring, err := seal.NewKeyRing(bytes.Repeat([]byte{7}, seal.KeySize))
	if err != nil {
		b.Fatal(err)
	}
	// Room for every first call of a long run: the default bounds fill up
	// with the records of some 50,000 calls.
	roomy := func() *memory.Store { return memory.New(memory.WithMaxRecords(1<<30), memory.WithMaxBytes(1<<40)) }
	plain := newBenchClient(b, grpc.UnaryInterceptor(grpctest.Interceptor(roomy())))
	sealed := newBenchClient(b, grpc.UnaryInterceptor(grpctest.Interceptor(roomy(), engine.WithSealer(ring))))
	req := request(1999)
	req.Description = strings.Repeat("d", 1024-52) // the Charge echoes it: a reply of 1 KiB
	replay := metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, "replay")
	for _, c := range []paymentsv1.PaymentServiceClient{plain, sealed} {
		resp, err := c.CreateCharge(replay, req)
		if err != nil {
			b.Fatal(err)
		}
		if n := proto.Size(resp); n < 1000 || n > 1048 {
			b.Fatalf("a reply of %d bytes, want about 1 KiB", n)
		}
	}
	call := func(c paymentsv1.PaymentServiceClient, ctx func(i int) context.Context) func(i int) error {
		return func(i int) error {
			_, err := c.CreateCharge(ctx(i), req)
			return err
		}
	}
	first := func(kind string) func(i int) context.Context {
		run := strconv.FormatInt(time.Now().UnixNano(), 36) // new keys on every run of the benchmark
		return func(i int) context.Context {
			return metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, kind+run+"-"+strconv.Itoa(i))
		}
	}
	again := func(int) context.Context { return replay }
	b.Run("call=first", func(b *testing.B) {
		means := benchtest.Interleave(b,
			benchtest.Op{Name: "plain", Run: call(plain, first("p"))},
			benchtest.Op{Name: "sealed", Run: call(sealed, first("s"))},
		)
		b.ReportMetric(means[1]/means[0], "sealed/plain")
	})
	b.Run("call=replay", func(b *testing.B) {
		means := benchtest.Interleave(b,
			benchtest.Op{Name: "plain", Run: call(plain, again)},
			benchtest.Op{Name: "sealed", Run: call(sealed, again)},
		)
		b.ReportMetric(means[1]/means[0], "sealed/plain")
	})
}

// BenchmarkInterceptorOverhead calls the interceptor function directly, as
// a gRPC server would but without one, against a bare handler, so that only
// idemkey's own work is timed: the bare handler, a first call (a new key
// each time) and a replay, interleaved. It reports each one's time, the
// first call's and the replay's ratio to the bare handler's, and the time
// and allocations they add to it.
func BenchmarkInterceptorOverhead(b *testing.B) {
	st := memory.New(memory.WithMaxRecords(1<<30), memory.WithMaxBytes(1<<40)) // room for every first call of a long run
	intercept := grpctest.Interceptor(st)
	info := &grpc.UnaryServerInfo{FullMethod: createCharge}
	handler := chargeHandler
	req := request(1999)
	if _, err := intercept(callContext("replay"), req, info, handler); err != nil {
		b.Fatal(err)
	}
	call := func(ctx *context.Context) func(int) error {
		return func(int) error {
			_, err := intercept(*ctx, req, info, handler)
			return err
		}
	}
	var firsts int // a new key for every first call, of Interleave's and Allocs' runs alike
	var bareCtx, firstCtx, replayCtx context.Context
	ops := []benchtest.Op{
		{Name: "bare", Run: func(int) error {
			_, err := handler(bareCtx, req)
			return err
		}, Before: func(int) { bareCtx = callContext("bare") }},
		{Name: "first", Run: call(&firstCtx), Before: func(int) {
			firsts++
			firstCtx = callContext("first-" + strconv.Itoa(firsts))
		}},
		{Name: "replay", Run: call(&replayCtx), Before: func(int) { replayCtx = callContext("replay") }},
	}
	ns := benchtest.Interleave(b, ops...)
	benchtest.ReportAdded(b, ops, ns, benchtest.Allocs(b, 1000, ops...))
}

// chargeHandler is the bare CreateCharge handler, for calling an interceptor
// without a server.
func chargeHandler(_ context.Context, req any) (any, error) {
	r := req.(*paymentsv1.CreateChargeRequest)
	return &paymentsv1.Charge{Id: "ch_0123456789abcdef01234567", CustomerId: r.GetCustomerId(), Amount: r.GetAmount(),
		Currency: r.GetCurrency(), Description: r.GetDescription()}, nil
}

// callContext is a call's context as grpc-go's server makes it, for calling
// an interceptor without a server: the incoming metadata it keeps
// (lower-case keys), with key, and a transport stream whose SetTrailer
// joins, as grpc-go's does.
func callContext(key string) context.Context {
	md := metadata.MD{":authority": {"bufnet"}, "user-agent": {"grpc-go/1.0"}, idemkey.KeyMetadata: {key}}
	return grpc.NewContextWithServerTransportStream(metadata.NewIncomingContext(context.Background(), md), &transportStream{})
}
