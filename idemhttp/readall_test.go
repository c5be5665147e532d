package idemhttp

import (
	"bytes"
	"io"
	"math"
	"strings"
	"testing"
)

// readAll reads what arrives, refuses what passes the limit, and makes no
// more room up front than preallocMax, whatever size the client claims.
func TestReadAll(t *testing.T) {
	for _, tc := range []struct {
		name        string
		body        string
		size, limit int64
		tooLarge    bool
	}{
		{"size given", "hello", 5, 1 << 20, false},
		{"size unknown", strings.Repeat("x", 2000), -1, 1 << 20, false},
		{"size understated", strings.Repeat("x", 2000), 10, 1 << 20, false},
		{"a claimed megabyte, five bytes sent", "hello", 1 << 20, 1 << 20, false},
		{"at the limit", strings.Repeat("x", 100), 100, 100, false},
		{"past the limit", strings.Repeat("x", 101), 101, 100, true},
		{"past the limit, size unknown", strings.Repeat("x", 101), -1, 100, true},
		{"no limit (math.MaxInt64)", "hello", -1, math.MaxInt64, false},
		{"no limit, a claimed size", "hello", 5, math.MaxInt64, false},
	} {
		b, tooLarge, err := readAll(io.LimitReader(strings.NewReader(tc.body), 1<<30), tc.size, tc.limit, nil)
		switch {
		case err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tooLarge != tc.tooLarge:
			t.Errorf("%s: too large %v; want %v", tc.name, tooLarge, tc.tooLarge)
		case !tooLarge && !bytes.Equal(b, []byte(tc.body)):
			t.Errorf("%s: read %d bytes; want the %d sent", tc.name, len(b), len(tc.body))
		case !tooLarge && cap(b) > max(len(tc.body)*2, preallocMax+1):
			t.Errorf("%s: a buffer of %d bytes for %d sent; want at most twice the bytes sent, or %d", tc.name, cap(b), len(tc.body), preallocMax+1)
		}
	}
}
