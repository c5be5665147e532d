package idemconnect_test

import (
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// retryPolicy is the example's: it retries UNAVAILABLE and ABORTED.
const retryPolicy = `{"methodConfig": [{
	"name": [{"service": "example.payments.v1.PaymentService", "method": "CreateCharge"}],
	"retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.01s", "maxBackoff": "0.1s", "backoffMultiplier": 2,
		"retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]}}]}`

func dialGRPC(t *testing.T, url string, opts ...grpc.DialOption) paymentsv1.PaymentServiceClient {
	conn, err := grpc.NewClient(strings.TrimPrefix(url, "http://"),
		append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return paymentsv1.NewPaymentServiceClient(conn)
}

// A grpc-go client calling a Connect server sees what it sees from the gRPC
// interceptor: the replay marked by the trailer, the in-progress answer with
// its reason and pushback trailer.
func TestGRPCClientOfConnectServer(t *testing.T) {
	b := newBlocker()
	attempts := &keyRecorder{}
	url := serve(t, b.handle, connect.UnaryInterceptorFunc(attempts.intercept), newInterceptor(t, single(t, engine.WithInProgressWait(0), engine.WithMaxRetryAfter(20*time.Millisecond))))
	plain := dialGRPC(t, url)
	withRetry := dialGRPC(t, url, grpc.WithDefaultServiceConfig(retryPolicy))
	ctx := metadata.AppendToOutgoingContext(t.Context(), idemkey.KeyMetadata, "k1")
	req := &paymentsv1.CreateChargeRequest{Amount: 100}

	type result struct {
		charge  *paymentsv1.Charge
		trailer metadata.MD
		err     error
	}
	first := make(chan result, 1)
	go func() {
		var r result
		r.charge, r.err = plain.CreateCharge(ctx, req, grpc.Trailer(&r.trailer))
		first <- r
	}()
	<-b.started

	var trailer metadata.MD
	_, err := plain.CreateCharge(ctx, req, grpc.Trailer(&trailer))
	if status.Code(err) != codes.Aborted || idemkey.Reason(err) != idemkey.ReasonInProgress {
		t.Fatalf("duplicate: %v; want Aborted, in progress", err)
	}
	if got := trailer.Get(interceptor.PushbackMetadata); len(got) != 1 || got[0] != "20" {
		t.Errorf("pushback trailer %q, want [20]", got)
	}
	if d, ok := idemkey.RetryDelay(err); !ok || d != 20*time.Millisecond {
		t.Errorf("RetryDelay %v, %v; want 20ms", d, ok)
	}

	// grpc-go retries only a trailers-only answer, which connect-go does
	// not send over HTTP/2: the retry policy gives up at once.
	attempts.take()
	_, err = withRetry.CreateCharge(ctx, req)
	if n := len(attempts.take()); status.Code(err) != codes.Aborted || n != 1 {
		t.Errorf("duplicate under the retry policy: %v after %d attempts; want Aborted after 1", err, n)
	}

	close(b.release)
	r := <-first
	if r.err != nil || idemkey.ParseReplayed(r.trailer.Get(idemkey.ReplayedMetadata)) {
		t.Fatalf("first call: %v, trailer %v", r.err, r.trailer)
	}
	var replayTrailer metadata.MD
	replay, err := plain.CreateCharge(ctx, req, grpc.Trailer(&replayTrailer))
	if err != nil || !proto.Equal(replay, r.charge) || !idemkey.ParseReplayed(replayTrailer.Get(idemkey.ReplayedMetadata)) {
		t.Fatalf("replay %v, %v, trailer %v; want %v marked replayed", replay, err, replayTrailer, r.charge)
	}
}
