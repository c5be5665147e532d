package interceptor

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/protokey/rpckit"
)

// refusal is the gRPC status of idemkey's answer a.
func refusal(a engine.Answer) error {
	return toError(rpckit.Refusal(context.Background(), a, missingKeyAdvice(context.Background())))
}

func TestStatuses(t *testing.T) {
	for _, tc := range []struct {
		err    error
		code   codes.Code
		reason string
	}{
		{refusal(engine.Answer{Verdict: engine.KeyMissing}), codes.InvalidArgument, idemkey.ReasonKeyMissing},
		{validateKey(""), codes.InvalidArgument, idemkey.ReasonKeyInvalid},
		{refusal(engine.Answer{Verdict: engine.Reused}), codes.InvalidArgument, idemkey.ReasonKeyReused},
		{refusal(engine.Answer{Verdict: engine.InProgress, RetryAfter: 1500 * time.Millisecond}), codes.Aborted, idemkey.ReasonInProgress},
		{refusal(engine.Answer{Verdict: engine.StoreUnavailable}), codes.Unavailable, idemkey.ReasonStoreUnavailable},
		{refusal(engine.Answer{Verdict: engine.StoreFull, RetryAfter: time.Second}), codes.ResourceExhausted, idemkey.ReasonStoreFull},
		{refusal(engine.Answer{Verdict: engine.Expired}), codes.FailedPrecondition, idemkey.ReasonKeyExpired},
		{refusal(engine.Answer{Verdict: engine.FirstSentInvalid}), codes.InvalidArgument, idemkey.ReasonFirstSentInvalid},
	} {
		if got := status.Code(tc.err); got != tc.code {
			t.Errorf("%v: code %v, want %v", tc.err, got, tc.code)
		}
		if got := idemkey.Reason(tc.err); got != tc.reason {
			t.Errorf("%v: reason %q, want %q", tc.err, got, tc.reason)
		}
		// Reason survives wrapping.
		if got := idemkey.Reason(fmt.Errorf("charge: %w", tc.err)); got != tc.reason {
			t.Errorf("wrapped %v: reason %q, want %q", tc.err, got, tc.reason)
		}
	}
	if d, ok := idemkey.RetryDelay(refusal(engine.Answer{Verdict: engine.InProgress, RetryAfter: 1500 * time.Millisecond})); !ok || d != 1500*time.Millisecond {
		t.Errorf("RetryDelay = %v, %v; want 1.5s", d, ok)
	}
	if _, ok := idemkey.RetryDelay(refusal(engine.Answer{Verdict: engine.Reused})); ok {
		t.Error("RetryDelay found a delay on a reused-key error")
	}
	for _, err := range []error{nil, fmt.Errorf("plain"), status.Error(codes.InvalidArgument, "other")} {
		if got := idemkey.Reason(err); got != "" {
			t.Errorf("idemkey.Reason(%v) = %q, want empty", err, got)
		}
	}
}

func TestPushbackTrailer(t *testing.T) {
	for d, want := range map[time.Duration]string{
		time.Second:             "1000",
		1500 * time.Microsecond: "2",
		time.Nanosecond:         "1",
		250 * time.Millisecond:  "250",
		// The longest durations round up without wrapping to a negative count.
		math.MaxInt64:                      "9223372036855",
		math.MaxInt64 - time.Millisecond/2: "9223372036855",
	} {
		if got := pushbackTrailer(d).Get(PushbackMetadata); len(got) != 1 || got[0] != want {
			t.Errorf("pushbackTrailer(%v) = %q, want [%s]", d, got, want)
		}
	}
}

func TestKeyFromMetadata(t *testing.T) {
	if key, ok, err := keyFromMetadata(metadata.Pairs(idemkey.KeyMetadata, "k-1")); key != "k-1" || !ok || err != nil {
		t.Errorf("one key: %q, %v, %v", key, ok, err)
	}
	if key, ok, err := keyFromMetadata(nil); key != "" || ok || err != nil {
		t.Errorf("no key: %q, %v, %v; want absent without error", key, ok, err)
	}
	// Spaces and horizontal tabs around the value are dropped, as
	// idemkey.ParseKey drops them on every entry point; no other whitespace.
	for _, v := range []string{" k-1 ", "\tk-1\t", " \t\"k-1\"\t "} {
		if key, ok, err := keyFromMetadata(metadata.Pairs(idemkey.KeyMetadata, v)); key != "k-1" || !ok || err != nil {
			t.Errorf("%q: %q, %v, %v; want k-1", v, key, ok, err)
		}
	}
	if key, _, err := keyFromMetadata(metadata.Pairs(idemkey.KeyMetadata, "\nk-1")); err == nil {
		t.Errorf("a line break before the key: %q; want the key refused", key)
	}
}

// keyErrorMessages are the messages of every kind of bad key, none of which
// depends on the key.
var keyErrorMessages = func() map[string]bool {
	msgs := map[string]bool{}
	for _, md := range []metadata.MD{
		{idemkey.KeyMetadata: {""}},
		{idemkey.KeyMetadata: {strings.Repeat("k", 256)}},
		{idemkey.KeyMetadata: {"\x00"}},
		{idemkey.KeyMetadata: {"a,b"}},      // neither an sf-string nor a bare key
		{idemkey.KeyMetadata: {`"a\b"`}},    // a backslash that escapes neither
		{idemkey.KeyMetadata: {`"a";p=1`}},  // parameters
		{idemkey.KeyMetadata: {`"a`}},       // no closing quote
		{idemkey.KeyMetadata: {"\"\x7f\""}}, // a string's byte outside printable ASCII
		{idemkey.KeyMetadata: {"a", "a"}},
		{idemkey.KeyMetadata + "-bin": {"a"}},
	} {
		_, _, err := keyFromMetadata(md)
		msgs[status.Convert(err).Message()] = true
	}
	return msgs
}()

// FuzzKeyFromMetadata: whatever arrives in metadata, parsing never panics,
// accepts only 1..255 bytes of visible ASCII, and never quotes the key.
func FuzzKeyFromMetadata(f *testing.F) {
	for _, seed := range []string{"", "k", "550e8400-e29b-41d4-a716-446655440000", "sp ace", "\x00", "\x7f", "é", strings.Repeat("x", 256),
		`"k"`, `"a\"b\\c"`, `"a";p=1`, `a,b`, `"sp ace"`} {
		f.Add(seed, false, false)
	}
	f.Add("k", true, false)
	f.Add("k", false, true)
	f.Fuzz(func(t *testing.T, key string, twice, binary bool) {
		md := metadata.MD{idemkey.KeyMetadata: {key}}
		if twice {
			md[idemkey.KeyMetadata] = append(md[idemkey.KeyMetadata], key)
		}
		if binary {
			md[idemkey.KeyMetadata+"-bin"] = []string{key}
		}
		got, ok, err := keyFromMetadata(md)
		if err != nil {
			if ok || got != "" {
				t.Fatalf("error %v with key %q, ok %v", err, got, ok)
			}
			if status.Code(err) != codes.InvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyInvalid {
				t.Fatalf("error %v, want InvalidArgument %s", err, idemkey.ReasonKeyInvalid)
			}
			if !keyErrorMessages[status.Convert(err).Message()] {
				t.Fatalf("error message %q is not one of the fixed ones; it must never quote the key", status.Convert(err).Message())
			}
			return
		}
		if want, _ := idemkey.ParseKey(key); !ok || got != want || twice || binary {
			t.Fatalf("accepted %q (ok %v) from %q, twice %v, binary %v; idemkey.ParseKey reads %q", got, ok, key, twice, binary, want)
		}
		if len(got) < 1 || len(got) > idemkey.MaxKeyLen {
			t.Fatalf("accepted a %d-byte key", len(got))
		}
		for i := 0; i < len(got); i++ {
			if got[i] < 0x21 || got[i] > 0x7e {
				t.Fatalf("accepted byte %#x", got[i])
			}
		}
		// A client's value for the key reads back as the key.
		if back, _, err := keyFromMetadata(metadata.MD{idemkey.KeyMetadata: {idemkey.FormatKey(got)}}); err != nil || back != got {
			t.Fatalf("idemkey.FormatKey(%q) = %q reads back as %q, %v", got, idemkey.FormatKey(got), back, err)
		}
	})
}

func TestKeyExpires(t *testing.T) {
	at := time.Date(2026, 12, 1, 20, 5, 37, 0, time.UTC)
	for _, tc := range []struct {
		name string
		mds  []metadata.MD
		ok   bool
	}{
		{"none", []metadata.MD{nil, {}}, false},
		{"header", []metadata.MD{metadata.Pairs(idemkey.ExpiresMetadata, idemkey.FormatDate(at)), nil}, true},
		{"trailer", []metadata.MD{nil, metadata.Pairs(idemkey.ExpiresMetadata, idemkey.FormatDate(at))}, true},
		{"malformed", []metadata.MD{metadata.Pairs(idemkey.ExpiresMetadata, "tomorrow")}, false},
		{"twice", []metadata.MD{metadata.Pairs(idemkey.ExpiresMetadata, idemkey.FormatDate(at), idemkey.ExpiresMetadata, idemkey.FormatDate(at))}, false},
	} {
		got, ok := keyExpires(tc.mds...)
		if ok != tc.ok || ok && !got.Equal(at) || !ok && !got.IsZero() {
			t.Errorf("%s: got %v, %v; want ok %v", tc.name, got, ok, tc.ok)
		}
	}
}
