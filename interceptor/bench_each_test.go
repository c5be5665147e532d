package interceptor_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/store/memory"
)

// The benchmarks of this file take BenchmarkOverhead apart. Its time ratios
// swing with a shared machine's load, so the kinds of call are also run one
// kind a sub-benchmark, for valgrind's callgrind to count their
// instructions, which do not (BENCHMARKS.md, "In process, round four", has
// the commands).

// roomyInterceptor is an interceptor on a memory store with room for every
// first call of a long run: the default bounds fill up with the records of
// some 100,000 calls.
func roomyInterceptor() grpc.UnaryServerInterceptor {
	return grpctest.Interceptor(memory.New(memory.WithMaxRecords(1<<30), memory.WithMaxBytes(1<<40)))
}

// trailerFloor is a server interceptor that does nothing but set md, made
// once: the floor of BenchmarkOverhead.
func trailerFloor(md metadata.MD) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		_ = grpc.SetTrailer(ctx, md)
		return handler(ctx, req)
	}
}

// BenchmarkOverheadEach makes BenchmarkOverhead's calls over bufconn, one
// kind a sub-benchmark: the bare call, the first call's floor, a first
// call, the replay's floor, a replay; and the first call's floor whose
// interceptor makes a first call aside, as BenchmarkOverheadAside does. Each
// call but a replay sends a new key, so that what the kinds differ by is the
// server's work alone (a new key costs grpc-go's HPACK some 5,000
// instructions more than one it has indexed).
func BenchmarkOverheadEach(b *testing.B) {
	expires := idemkey.FormatDate(time.Now().Add(24 * time.Hour))
	info := &grpc.UnaryServerInfo{FullMethod: createCharge}
	asideKey := "warm-up" // the key of the first call made aside
	for _, kind := range []struct {
		name      string
		intercept func() grpc.UnaryServerInterceptor // nil: the bare call
		replay    bool
	}{
		{name: "bare"},
		{name: "first-floor", intercept: func() grpc.UnaryServerInterceptor {
			return trailerFloor(metadata.MD{idemkey.ExpiresMetadata: {expires}, idemkey.ReplayedMetadata: {"false"}})
		}},
		{name: "first", intercept: roomyInterceptor},
		{name: "replay-floor", intercept: func() grpc.UnaryServerInterceptor {
			return trailerFloor(metadata.MD{idemkey.ExpiresMetadata: {expires}, idemkey.ReplayedMetadata: {"true"}})
		}},
		{name: "replay", intercept: roomyInterceptor, replay: true},
		{name: "aside", intercept: func() grpc.UnaryServerInterceptor {
			aside, floor := roomyInterceptor(), trailerFloor(metadata.MD{idemkey.ExpiresMetadata: {expires}, idemkey.ReplayedMetadata: {"false"}})
			return func(ctx context.Context, req any, i *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
				if _, err := aside(callContext(asideKey), req, info, chargeHandler); err != nil {
					return nil, err
				}
				return floor(ctx, req, i, handler)
			}
		}},
	} {
		b.Run("call="+kind.name, func(b *testing.B) {
			var opts []grpc.ServerOption
			if kind.intercept != nil {
				opts = append(opts, grpc.UnaryInterceptor(kind.intercept()))
			}
			client := newBenchClient(b, opts...)
			req := request(1999)
			if _, err := client.CreateCharge(metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, "replay"), req); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				key := "first-" + strconv.Itoa(i)
				if kind.replay {
					key = "replay"
				}
				asideKey = key
				if _, err := client.CreateCharge(metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, key), req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkInterceptorEach makes BenchmarkInterceptorOverhead's calls of the
// interceptor function, without grpc-go, one kind a sub-benchmark: the bare
// handler, a first call, a replay.
func BenchmarkInterceptorEach(b *testing.B) {
	info := &grpc.UnaryServerInfo{FullMethod: createCharge}
	for _, kind := range []string{"bare", "first", "replay"} {
		b.Run("call="+kind, func(b *testing.B) {
			intercept := roomyInterceptor()
			req := request(1999)
			if _, err := intercept(callContext("replay"), req, info, chargeHandler); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				key := "first-" + strconv.Itoa(i)
				if kind == "replay" {
					key = "replay"
				}
				ctx := callContext(key)
				var err error
				if kind == "bare" {
					_, err = chargeHandler(ctx, req)
				} else {
					_, err = intercept(ctx, req, info, chargeHandler)
				}
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkOverheadAside asks whether what a first call adds to its floor
// is grpc-go's, for the trailer and the metadata idemkey reads, or that of
// idemkey's work done inside a gRPC call. It times, interleaved: the floor;
// a first call; the floor whose interceptor first makes a first call of its
// own aside, on a context of its own as BenchmarkInterceptorOverhead makes
// it, that the gRPC call never sees; and that first call made alone. Each
// gRPC call sends a new key. It reports what the first call and the aside
// add to the floor, and the time of the call alone.
func BenchmarkOverheadAside(b *testing.B) {
	info := &grpc.UnaryServerInfo{FullMethod: createCharge}
	floor := trailerFloor(metadata.MD{idemkey.ExpiresMetadata: {idemkey.FormatDate(time.Now().Add(24 * time.Hour))}})
	aside, alone := roomyInterceptor(), roomyInterceptor()
	floorClient := newBenchClient(b, grpc.UnaryInterceptor(floor))
	firstClient := newBenchClient(b, grpc.UnaryInterceptor(roomyInterceptor()))
	var asideCtx context.Context // the aside call's, made before it is timed
	asideClient := newBenchClient(b, grpc.UnaryInterceptor(func(ctx context.Context, req any, i *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if _, err := aside(asideCtx, req, info, chargeHandler); err != nil {
			return nil, err
		}
		return floor(ctx, req, i, handler)
	}))
	req := request(1999)
	var keys int                // a new key for every call
	var out, in context.Context // the call's outgoing metadata, and a call alone's context
	newKey := func(int) {
		keys++
		key := "first-" + strconv.Itoa(keys)
		out = metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, key)
		in = callContext(key)
	}
	ns := benchtest.Interleave(b,
		benchtest.Op{Name: "floor", Run: func(int) error { _, err := floorClient.CreateCharge(out, req); return err }, Before: newKey},
		benchtest.Op{Name: "first", Run: func(int) error { _, err := firstClient.CreateCharge(out, req); return err }, Before: newKey},
		benchtest.Op{Name: "aside", Run: func(int) error { _, err := asideClient.CreateCharge(out, req); return err }, Before: func(i int) {
			newKey(i)
			asideCtx = in
		}},
		benchtest.Op{Name: "alone", Run: func(int) error { _, err := alone(in, req, info, chargeHandler); return err }, Before: newKey},
	)
	b.ReportMetric((ns[1]-ns[0])/1e3, "first-over-floor-µs")
	b.ReportMetric((ns[2]-ns[0])/1e3, "aside-over-floor-µs")
	b.ReportMetric(ns[3]/1e3, "alone-µs")
}
