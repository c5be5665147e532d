package idemhttp_test

import (
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/idemhttp"
)

func TestKeyFromHeader(t *testing.T) {
	long := strings.Repeat("k", idemkey.MaxKeyLen)
	for _, tc := range []struct {
		name    string
		values  []string // nil: no field
		key     string
		invalid bool
	}{
		{name: "no field", values: nil},
		{name: "sf-string", values: []string{`"8e03978e-40d5-43e8-bc93-6894a57f9324"`}, key: "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{name: "sf-string with escapes", values: []string{`"a\"b\\c"`}, key: `a"b\c`},
		{name: "surrounding whitespace", values: []string{" \t\"k1\" "}, key: "k1"},
		{name: "bare token, as Stripe's clients send", values: []string{"8e03978e-40d5-43e8-bc93-6894a57f9324"}, key: "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{name: "bare with a backslash", values: []string{`a\b`}, key: `a\b`},
		{name: "longest", values: []string{`"` + long + `"`}, key: long},
		{name: "longest bare", values: []string{long}, key: long},
		{name: "too long", values: []string{`"` + long + `k"`}, invalid: true},
		{name: "too long bare", values: []string{long + "k"}, invalid: true},
		{name: "much too long", values: []string{`"` + strings.Repeat("k", 10000) + `"`}, invalid: true},
		{name: "empty field", values: []string{""}, invalid: true},
		{name: "empty string", values: []string{`""`}, invalid: true},
		{name: "space inside", values: []string{`"a b"`}, invalid: true},
		{name: "control byte", values: []string{"\"a\x01b\""}, invalid: true},
		{name: "non-ASCII", values: []string{"\"a\xc3\xa9\""}, invalid: true},
		{name: "non-ASCII bare", values: []string{"a\xc3\xa9"}, invalid: true},
		{name: "unterminated", values: []string{`"abc`}, invalid: true},
		{name: "bad escape", values: []string{`"a\nb"`}, invalid: true},
		{name: "escape at the end", values: []string{`"abc\`}, invalid: true},
		{name: "list", values: []string{`"a", "b"`}, invalid: true},
		{name: "bare list", values: []string{`a,b`}, invalid: true},
		{name: "parameters", values: []string{`"a";p=1`}, invalid: true},
		{name: "bare parameters", values: []string{`a;p=1`}, invalid: true},
		{name: "quote inside bare", values: []string{`a"b"`}, invalid: true},
		{name: "two fields", values: []string{`"k1"`, `"k1"`}, invalid: true},
		{name: "two fields, one empty", values: []string{`"k1"`, ``}, invalid: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := http.Header{}
			for _, v := range tc.values {
				h.Add(idemkey.KeyHeader, v)
			}
			key, ok, err := idemhttp.KeyFromHeader(h)
			var keyErr *idemkey.KeyError
			switch {
			case tc.values == nil:
				if ok || err != nil {
					t.Fatalf("got %q, %v, %v; want no key", key, ok, err)
				}
			case tc.invalid:
				if !ok || !errors.As(err, &keyErr) || key != "" {
					t.Fatalf("got %q, %v, %v; want a *idemkey.KeyError", key, ok, err)
				}
				if strings.Contains(err.Error(), "k1") || strings.Contains(err.Error(), "kkkk") {
					t.Fatalf("the error %q quotes the key", err)
				}
			default:
				if !ok || err != nil || key != tc.key {
					t.Fatalf("got %q, %v, %v; want %q", key, ok, err, tc.key)
				}
			}
		})
	}
}

// FuzzKeyHeader checks that no field value panics the parser, that a key it
// accepts passes idemkey.ValidateKey, and that it reads back its own format.
func FuzzKeyHeader(f *testing.F) {
	for _, v := range []string{`"k1"`, `k1`, `"a\"b\\c"`, `"a", "b"`, `"a";p=1`, `"abc\`, ``, `""`, " \"x\" ", "\"\x7f\""} {
		f.Add(v)
	}
	f.Fuzz(func(t *testing.T, v string) {
		key, ok, err := idemhttp.KeyFromHeader(http.Header{idemkey.KeyHeader: {v}})
		if !ok {
			t.Fatalf("KeyFromHeader(%q): a field, yet no key", v)
		}
		if err != nil {
			var keyErr *idemkey.KeyError
			if !errors.As(err, &keyErr) || key != "" {
				t.Fatalf("KeyFromHeader(%q) = %q, %v: want a *idemkey.KeyError and no key", v, key, err)
			}
			return
		}
		if err := idemkey.ValidateKey(key); err != nil {
			t.Fatalf("KeyFromHeader(%q) = %q, which fails ValidateKey: %v", v, key, err)
		}
		back, _, err := idemhttp.KeyFromHeader(http.Header{idemkey.KeyHeader: {idemkey.FormatKey(key)}})
		if err != nil || back != key {
			t.Fatalf("FormatKey(%q) reads back as %q, %v", key, back, err)
		}
	})
}

// The middleware reads its fields by their names as they are, without
// canonicalizing them each request: they must be canonical already.
func TestFieldNamesAreCanonical(t *testing.T) {
	for _, name := range []string{idemkey.KeyHeader, idemkey.FirstSentHeader, idemkey.FirstRegionHeader, idemkey.ReplayedHeader, idemkey.ExpiresHeader, idemkey.StatusHeader, "Content-Type"} {
		if c := http.CanonicalHeaderKey(name); c != name {
			t.Errorf("%q is not canonical: %q", name, c)
		}
	}
}
