package idemkey_test

import (
	"fmt"
	"time"

	"github.com/idemkey/idemkey"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// A client tells idemkey's errors apart by their reason.
func ExampleReason() {
	for _, err := range []error{
		reused(),
		inProgress(500 * time.Millisecond),
		fmt.Errorf("card declined"),
	} {
		switch idemkey.Reason(err) {
		case idemkey.ReasonKeyReused:
			fmt.Println("bug: one key was used for two different requests")
		case idemkey.ReasonInProgress:
			delay, _ := idemkey.RetryDelay(err)
			fmt.Println("still running; retry with the same key in", delay)
		default:
			fmt.Println("not an idemkey error:", err)
		}
	}
	// Output:
	// bug: one key was used for two different requests
	// still running; retry with the same key in 500ms
	// not an idemkey error: card declined
}

// reused and inProgress stand for the errors a gRPC client gets from a
// server with idemkey's interceptor; a Connect client's *connect.Error
// reads the same.
func reused() error {
	st, _ := status.New(codes.InvalidArgument, "idempotency key already used with a different request").
		WithDetails(&errdetails.ErrorInfo{Reason: idemkey.ReasonKeyReused, Domain: idemkey.ErrorDomain})
	return st.Err()
}

func inProgress(d time.Duration) error {
	st, _ := status.New(codes.Aborted, "a call with this idempotency key is in progress").
		WithDetails(&errdetails.ErrorInfo{Reason: idemkey.ReasonInProgress, Domain: idemkey.ErrorDomain},
			&errdetails.RetryInfo{RetryDelay: durationpb.New(d)})
	return st.Err()
}
