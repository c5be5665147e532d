package idemkey_test

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
)

var uuidV4 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestNewKey(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		k := idemkey.NewKey()
		if !uuidV4.MatchString(k) {
			t.Fatalf("NewKey() = %q, not a version 4 UUID", k)
		}
		if err := idemkey.ValidateKey(k); err != nil {
			t.Fatalf("NewKey() = %q is not a valid key: %v", k, err)
		}
		if seen[k] {
			t.Fatalf("NewKey() repeated %q", k)
		}
		seen[k] = true
	}
}

var uuidV8 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-8[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// A derived key is a valid key, the same for the same parts, and different
// when any one part differs, including where parts could run together.
func TestDeriveKey(t *testing.T) {
	base := [4]string{"acme", "/pay.v1.Payments/Charge", "k-1", "provider"}
	derive := func(p [4]string) string { return idemkey.DeriveKey(p[0], p[1], p[2], p[3]) }
	k := derive(base)
	if !uuidV8.MatchString(k) || idemkey.ValidateKey(k) != nil {
		t.Fatalf("DeriveKey = %q, want a version 8 UUID", k)
	}
	if again := derive(base); again != k {
		t.Errorf("DeriveKey is not stable: %q, then %q", k, again)
	}
	// A derived key leaves the process (a downstream API keeps it), so its
	// value for given parts never changes between releases.
	if want := "d9513693-a5e2-8b96-a6d3-c0b9a86178de"; k != want {
		t.Errorf("DeriveKey(%q) = %q, the key earlier releases derived is %q", base, k, want)
	}
	seen := map[string]int{k: -1}
	for i := range base {
		p := base
		p[i] += "x"
		if prev, dup := seen[derive(p)]; dup {
			t.Errorf("changing part %d derives the key of %d", i, prev)
		}
		seen[derive(p)] = i
	}
	if derive([4]string{"ab", "c", "k", "l"}) == derive([4]string{"a", "bc", "k", "l"}) {
		t.Error("parts that run together derive one key")
	}
}

// A client's value for a key is the key as an RFC 8941 string, with " and
// \ escaped, even where a bare key would read back too, and reads back as
// the key on every entry point.
func TestFormatKey(t *testing.T) {
	for key, want := range map[string]string{
		"k1":                                   `"k1"`,
		"42":                                   `"42"`,
		"8e03978e-40d5-43e8-bc93-6894a57f9324": `"8e03978e-40d5-43e8-bc93-6894a57f9324"`,
		`a"b\c`:                                `"a\"b\\c"`,
		`a"b`:                                  `"a\"b"`,
		`"quoted"`:                             `"\"quoted\""`,
		"a,b":                                  `"a,b"`,
		"a;b":                                  `"a;b"`,
	} {
		v := idemkey.FormatKey(key)
		if v != want {
			t.Errorf("FormatKey(%q) = %s, want %s", key, v, want)
		}
		if got, err := idemkey.ParseKey(v); err != nil || got != key {
			t.Errorf("FormatKey(%q) = %s reads back as %q, %v", key, v, got, err)
		}
	}
}

// ParseKey drops spaces and horizontal tabs around a value, as HTTP drops
// the optional whitespace around a field value (RFC 9110, section 5.6.3),
// and no other whitespace: a key holds none, and a line break or form feed
// around one makes it malformed.
func TestParseKey(t *testing.T) {
	for v, want := range map[string]string{
		"k1":           "k1",
		` "k1"`:        "k1",
		"\t\"k1\"\t":   "k1",
		" \t k1 \t ":   "k1",
		"\tk1":         "k1",
		"k1\t":         "k1",
		"\t\"a\\\"b\"": `a"b`,
	} {
		if got, err := idemkey.ParseKey(v); err != nil || got != want {
			t.Errorf("ParseKey(%q) = %q, %v; want %q", v, got, err, want)
		}
	}
	for _, v := range []string{"\nk1", "k1\r\n", "\vk1", "k1\f", "\u00a0k1", "k\t1", `"k\t1"`, " \t ", `" k1"`, "\t\"k1\" x"} {
		if got, err := idemkey.ParseKey(v); err == nil {
			t.Errorf("ParseKey(%q) = %q; want a *KeyError", v, got)
		}
	}
}

func TestParseReplayed(t *testing.T) {
	if !idemkey.ParseReplayed([]string{"true"}) {
		t.Error(`ParseReplayed(["true"]) = false`)
	}
	for _, vs := range [][]string{nil, {"false"}, {"TRUE"}, {"true", "true"}, {""}} {
		if idemkey.ParseReplayed(vs) {
			t.Errorf("ParseReplayed(%q) = true", vs)
		}
	}
}

// TestParseFate reads the three fates of a keyed call's answer, and nothing
// else, in the values a client gets.
func TestParseFate(t *testing.T) {
	if !idemkey.ParseExecuted([]string{"false"}) || !idemkey.ParseIgnored([]string{idemkey.StatusIgnored}) {
		t.Error(`ParseExecuted(["false"]) or ParseIgnored(["ignored"]) = false`)
	}
	for _, vs := range [][]string{nil, {"true"}, {"FALSE"}, {"false", "false"}, {""}} {
		if idemkey.ParseExecuted(vs) {
			t.Errorf("ParseExecuted(%q) = true", vs)
		}
	}
	for _, vs := range [][]string{nil, {"Ignored"}, {"ignored", "ignored"}, {"false"}} {
		if idemkey.ParseIgnored(vs) {
			t.Errorf("ParseIgnored(%q) = true", vs)
		}
	}
}

func TestValidateRegion(t *testing.T) {
	for _, name := range []string{"a", "eu-west-1", "0", "-", strings.Repeat("z", 63)} {
		if err := idemkey.ValidateRegion(name); err != nil {
			t.Errorf("ValidateRegion(%q) = %v, want nil", name, err)
		}
	}
	for _, name := range []string{"", "EU", "eu_west", "eu west", "eu.west", "é", strings.Repeat("z", 64)} {
		err := idemkey.ValidateRegion(name)
		if err == nil || name != "" && strings.Contains(err.Error(), name) {
			t.Errorf("ValidateRegion(%q) = %v, want an error that does not quote it", name, err)
		}
	}
}

func TestContextWithKeyFirstRegion(t *testing.T) {
	at := time.Unix(1e9, 0)
	ctx := idemkey.ContextWithKeyFirstRegion(context.Background(), "k1", at, "eu-west-1")
	key, sent, ok := idemkey.KeyFromContext(ctx)
	if key != "k1" || !sent.Equal(at) || !ok || idemkey.FirstRegionFromContext(ctx) != "eu-west-1" {
		t.Errorf("got %q, %v, %v, region %q", key, sent, ok, idemkey.FirstRegionFromContext(ctx))
	}
	// A later key without a region replaces the key and its region.
	if r := idemkey.FirstRegionFromContext(idemkey.ContextWithKey(ctx, "k2")); r != "" {
		t.Errorf("ContextWithKey over a region: region %q, want none", r)
	}
}
