package idemkey_test

import (
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemkey/idemkey"
)

// TestReason: Reason and RetryDelay read a gRPC status error however it is
// wrapped, and nothing else. A Connect error is read in idemconnect's tests
// (this module does not require connect-go).
func TestReason(t *testing.T) {
	st, err := status.New(codes.Aborted, "in progress").WithDetails(
		&errdetails.ErrorInfo{Reason: idemkey.ReasonInProgress, Domain: idemkey.ErrorDomain},
		&errdetails.RetryInfo{RetryDelay: durationpb.New(1500 * time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	foreign, _ := status.New(codes.InvalidArgument, "other").WithDetails(
		&errdetails.ErrorInfo{Reason: idemkey.ReasonKeyReused, Domain: "example.com"})
	for _, err := range []error{st.Err(), fmt.Errorf("charge: %w", st.Err()), errors.Join(st.Err(), errors.New("x"))} {
		if got := idemkey.Reason(err); got != idemkey.ReasonInProgress {
			t.Errorf("Reason(%v) = %q, want %s", err, got, idemkey.ReasonInProgress)
		}
		if d, ok := idemkey.RetryDelay(err); !ok || d != 1500*time.Millisecond {
			t.Errorf("RetryDelay(%v) = %v, %v; want 1.5s", err, d, ok)
		}
	}
	for _, err := range []error{nil, errors.New("plain"), status.Error(codes.InvalidArgument, "no details"), foreign.Err()} {
		if got := idemkey.Reason(err); got != "" {
			t.Errorf("Reason(%v) = %q, want none", err, got)
		}
		if d, ok := idemkey.RetryDelay(err); ok {
			t.Errorf("RetryDelay(%v) = %v, want none", err, d)
		}
	}
}

// TestDurationSaturates: a RetryInfo delay at the edges of Duration's range
// saturates, as durationpb's AsDuration does, rather than wrap around.
func TestDurationSaturates(t *testing.T) {
	for _, tc := range []struct {
		seconds, nanos int64
		want           time.Duration
	}{
		{1, 500, time.Second + 500},
		{9223372036, 999999999, math.MaxInt64},
		{-9223372036, -999999999, math.MinInt64},
		{math.MaxInt64, 0, math.MaxInt64},
		{math.MinInt64, 0, math.MinInt64},
		{9223372036, 854775807, math.MaxInt64},
	} {
		if got := idemkey.DurationOf(tc.seconds, tc.nanos); got != tc.want {
			t.Errorf("durationOf(%d, %d) = %v, want %v", tc.seconds, tc.nanos, got, tc.want)
		}
	}
}
