package example_test

// This file is docs/operations.md's hooks snippet, between the markers; the
// page's copy must match it (TestREADMESnippets), and its output is the
// page's too.

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// readme:hooks
// audit writes one line per call: a charge executed once, however often its
// client retried, then a replay per retry. The hook is your code: it sees
// the raw key and tenant, which idemkey never logs, and runs before the
// answer is sent.
func audit(w io.Writer) engine.Hooks {
	line := func(ctx context.Context, ev engine.Event) {
		fmt.Fprintf(w, "%-8s %s tenant=%s key=%s code=%v record=%dB\n",
			ev.Verdict, ev.Operation, ev.Tenant, ev.Key, codes.Code(ev.Code), ev.Size)
	}
	return engine.Hooks{OnExecute: line, OnReplay: line, OnRefuse: line}
}

func newAuditedServer(payments paymentsv1.PaymentServiceServer, w io.Writer) (*grpc.Server, error) {
	eng, err := engine.New(memory.New(), engine.WithTenant(callerTenant), engine.WithHooks(audit(w)))
	if err != nil {
		return nil, err
	}
	idem, err := interceptor.UnaryServerInterceptor(eng)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(authInterceptor, idem))
	paymentsv1.RegisterPaymentServiceServer(srv, payments)
	return srv, nil
}

// end readme

// fixedCharges answers every charge with the same id, so that the output
// is the same on every run.
type fixedCharges struct {
	paymentsv1.UnimplementedPaymentServiceServer
}

func (fixedCharges) CreateCharge(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	return &paymentsv1.Charge{Id: "ch_1", CustomerId: req.GetCustomerId(), Amount: req.GetAmount(), Currency: req.GetCurrency()}, nil
}

// A charge sent three times with one key (a client retrying after lost
// replies), then the key sent again with another amount.
func Example_hooks() {
	srv, err := newAuditedServer(fixedCharges{}, os.Stdout)
	if err != nil {
		panic(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	go srv.Serve(lis)
	defer srv.Stop()
	keys, err := interceptor.UnaryClientInterceptor() // reads UseKey
	if err != nil {
		panic(err)
	}
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(keys))
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	client := paymentsv1.NewPaymentServiceClient(conn)

	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer acme")
	for _, amount := range []int64{1999, 1999, 1999, 2500} {
		_, _ = client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: amount, Currency: "EUR"},
			interceptor.UseKey("order-1001"))
	}
	// Output:
	// executed /example.payments.v1.PaymentService/CreateCharge tenant=acme key=order-1001 code=OK record=23B
	// replayed /example.payments.v1.PaymentService/CreateCharge tenant=acme key=order-1001 code=OK record=23B
	// replayed /example.payments.v1.PaymentService/CreateCharge tenant=acme key=order-1001 code=OK record=23B
	// reused   /example.payments.v1.PaymentService/CreateCharge tenant=acme key=order-1001 code=InvalidArgument record=0B
}

// docs/operations.md shows Example_hooks's output as it is: the lines of
// its // Output: comment, in a ```text block.
func TestREADMEHooksOutput(t *testing.T) {
	src, err := os.ReadFile("readme_hooks_test.go")
	if err != nil {
		t.Fatal(err)
	}
	_, out, ok := strings.Cut(string(src), "\t// Output:\n")
	if !ok {
		t.Fatal("Example_hooks has no // Output: comment")
	}
	var want strings.Builder
	for line := range strings.Lines(out) {
		text, ok := strings.CutPrefix(line, "\t// ")
		if !ok {
			break
		}
		want.WriteString(text)
	}
	readme, err := os.ReadFile(filepath.Join("..", "docs", "operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "```text\n"+want.String()+"```\n") {
		t.Errorf("docs/operations.md has no ```text block of Example_hooks's output:\n%s", want.String())
	}
}
