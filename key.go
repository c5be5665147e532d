package idemkey

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"strings"
	"time"
)

// KeyError is a malformed idempotency key. Problem says what is wrong with
// it and never quotes the key.
type KeyError struct{ Problem string }

func (e *KeyError) Error() string { return "idempotency key malformed: " + e.Problem }

// ValidateKey returns a *KeyError unless key is 1 to MaxKeyLen bytes of
// visible ASCII (0x21 to 0x7E): a UUID, a ULID or base64url text qualify.
func ValidateKey(key string) error {
	if key == "" {
		return &KeyError{"it is empty"}
	}
	if len(key) > MaxKeyLen {
		return &KeyError{"it is longer than 255 bytes"}
	}
	for i := 0; i < len(key); i++ {
		if key[i] < 0x21 || key[i] > 0x7e {
			return &KeyError{"it holds a byte outside visible ASCII (0x21 to 0x7E)"}
		}
	}
	return nil
}

// ValidateRegion returns an error unless name is a region name: 1 to 63
// bytes of a-z, 0-9 and "-", as a DNS label (FirstRegionHeader). The error
// never quotes the name.
func ValidateRegion(name string) error {
	if name == "" || len(name) > maxRegionLen {
		return errRegion
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return errRegion
		}
	}
	return nil
}

// maxRegionLen is the longest region name, in bytes: a DNS label's.
const maxRegionLen = 63

var errRegion = errors.New("a region name is 1 to 63 bytes of a-z, 0-9 and -")

// ParseKey reads a key header or metadata value the same way on every entry
// point: an RFC 8941 sf-string, as the IETF draft has it, or, as most
// clients send it, the bare key, without double quote, comma or semicolon.
// Spaces and tabs around it are dropped (RFC 9110, section 5.6.3). The key
// must pass ValidateKey; an error is a *KeyError.
func ParseKey(v string) (string, error) {
	v = strings.Trim(v, " \t")
	if v == "" || v[0] != '"' {
		if strings.ContainsAny(v, "\",;") {
			return "", &KeyError{Problem: "it is neither a structured-field string nor a bare key"}
		}
		return v, ValidateKey(v)
	}
	// RFC 8941, section 4.2.5: DQUOTE *chr DQUOTE, chr printable ASCII but "
	// and \, or \" or \\. A key with no escape is a substring of v; b is
	// written only from the first escape on.
	var b strings.Builder
	escaped, n := false, 0 // n: the key's bytes so far
	for i := 1; i < len(v); i++ {
		switch c := v[i]; {
		case c == '\\':
			i++
			if i == len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", &KeyError{Problem: "its string holds a backslash that escapes neither \" nor \\"}
			}
			if !escaped {
				escaped = true
				b.Grow(min(len(v), MaxKeyLen+2))
				b.WriteString(v[1 : i-1])
			}
			b.WriteByte(v[i])
			n++
		case c == '"':
			if i != len(v)-1 {
				return "", &KeyError{Problem: "something follows its string: a list or parameters"}
			}
			key := v[1:i]
			if escaped {
				key = b.String()
			}
			return key, ValidateKey(key)
		case c < 0x20 || c > 0x7e:
			return "", &KeyError{Problem: "its string holds a byte outside printable ASCII"}
		default:
			if n > MaxKeyLen {
				return "", &KeyError{Problem: "it is longer than 255 bytes"}
			}
			if escaped {
				b.WriteByte(c)
			}
			n++
		}
	}
	return "", &KeyError{Problem: "its string has no closing double quote"}
}

// FormatKey returns key as an Idempotency-Key header value for an HTTP or
// Connect client: an RFC 8941 sf-string, in double quotes with " and \
// escaped, the form the draft gives the field; a strict server refuses most
// keys sent bare, or reads them as another type. key should pass ValidateKey.
func FormatKey(key string) string {
	var b strings.Builder
	b.Grow(len(key) + 2)
	b.WriteByte('"')
	for i := 0; i < len(key); i++ {
		if key[i] == '"' || key[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(key[i])
	}
	b.WriteByte('"')
	return b.String()
}

// NewKey returns a fresh random key, a version 4 UUID. Keep it with the
// operation it names, so that a restarted process retries with the same key.
func NewKey() string {
	var u [16]byte
	rand.Read(u[:])
	return formatUUID(u, 4)
}

// ContextWithKey returns a context whose calls carry key, for idemkey's
// client interceptors; a key the call itself carries wins. Every covered
// call made with it carries the key: use one context per operation.
func ContextWithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, clientKey{}, clientContext{key: key})
}

// ContextWithKeyFirstSent is ContextWithKey that also sends when the key's
// operation was first sent (FirstSentHeader), so that the server refuses a
// retry whose record may have expired (ReasonKeyExpired) rather than run it
// again. A zero firstSent sends the time of each call.
func ContextWithKeyFirstSent(ctx context.Context, key string, firstSent time.Time) context.Context {
	return context.WithValue(ctx, clientKey{}, clientContext{key: key, firstSent: firstSent})
}

// ContextWithKeyFirstRegion is ContextWithKeyFirstSent that also sends the
// region the key's operation was first sent to (FirstRegionHeader): a client
// that fails over to another region with a saved key sends where it first
// sent it, so that a server of another region (engine.WithRegion) runs
// nothing until the first region's record reaches it. An empty region
// sends none; a region with a zero firstSent fails the call in the client
// interceptors, since the key would then never grow stale in a region that
// lacks its record.
func ContextWithKeyFirstRegion(ctx context.Context, key string, firstSent time.Time, region string) context.Context {
	return context.WithValue(ctx, clientKey{}, clientContext{key: key, firstSent: firstSent, region: region})
}

// KeyFromContext returns what ContextWithKey, ContextWithKeyFirstSent or
// ContextWithKeyFirstRegion put in ctx, for a client interceptor; firstSent
// may be zero.
func KeyFromContext(ctx context.Context) (key string, firstSent time.Time, ok bool) {
	c, ok := ctx.Value(clientKey{}).(clientContext)
	return c.key, c.firstSent, ok
}

// FirstRegionFromContext returns the region ContextWithKeyFirstRegion put in
// ctx with its key, for a client interceptor; "" for none.
func FirstRegionFromContext(ctx context.Context) string {
	c, _ := ctx.Value(clientKey{}).(clientContext)
	return c.region
}

type clientKey struct{}

type clientContext struct {
	key       string
	firstSent time.Time
	region    string // "": none
}

// DeriveKey returns the key for a call, named by label, that one operation
// makes to another idempotent API: a version 8 UUID from the SHA-256 of the
// parts. Every retry derives the same key, so the downstream API
// deduplicates too. In a handler, DerivedKey fills in the call's own parts.
func DeriveKey(tenant, operation, key, label string) string {
	sum := sha256.Sum256(appendParts(make([]byte, 0, 512), "idemkey derived key v1", tenant, operation, key, label))
	return formatUUID([16]byte(sum[:16]), 8)
}

// appendParts is store.AppendParts, copied so that this package imports
// nothing of the module. A derived key leaves the process: never change it.
func appendParts(b []byte, parts ...string) []byte {
	for _, p := range parts {
		b = binary.BigEndian.AppendUint64(b, uint64(len(p)))
		b = append(b, p...)
	}
	return b
}

// formatUUID sets u's version and RFC 9562 variant bits and formats it.
func formatUUID(u [16]byte, version byte) string {
	u[6] = u[6]&0x0f | version<<4
	u[8] = u[8]&0x3f | 0x80
	var b [36]byte
	hex.Encode(b[0:8], u[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], u[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], u[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], u[8:10])
	b[23] = '-'
	hex.Encode(b[24:], u[10:])
	return string(b[:])
}

type parts struct{ tenant, operation, key string }

// HandlerContext returns ctx carrying the call's parts for DerivedKey. The
// engine calls it; an adapter has no need to.
func HandlerContext(ctx context.Context, tenant, operation, key string) context.Context {
	return &partsContext{ctx, parts{tenant, operation, key}}
}

type partsKey struct{}

// partsContext is one allocation per call, where context.WithValue is two.
type partsContext struct {
	context.Context
	parts parts
}

func (p *partsContext) Value(key any) any {
	if key == (partsKey{}) {
		return &p.parts
	}
	return p.Context.Value(key)
}

// DerivedKey returns DeriveKey of the tenant, operation and key of the call
// whose handler ctx is, and label. ok is false if ctx is not a handler's.
func DerivedKey(ctx context.Context, label string) (key string, ok bool) {
	p, ok := ctx.Value(partsKey{}).(*parts)
	if !ok {
		return "", false
	}
	return DeriveKey(p.tenant, p.operation, p.key, label), true
}
