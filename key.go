package idemkey

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"strings"
	"time"
)

// KeyError is a malformed idempotency key. Problem says what is wrong with
// it and never quotes the key.
type KeyError struct{ Problem string }

func (e *KeyError) Error() string { return "idempotency key malformed: " + e.Problem }

// ValidateKey returns a *KeyError unless key is 1 to MaxKeyLen bytes of
// visible ASCII (0x21 to 0x7E). A UUID, a ULID or base64url text all
// qualify. Every entry point checks keys with it.
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

// ParseKey reads the key that one value of the key's header or metadata
// names, the same way on every entry point (gRPC metadata, gRPC-Web, Connect
// and HTTP headers), so that one value names one key wherever it is sent.
// The value is read as draft-ietf-httpapi-idempotency-key-header-07 defines
// the Idempotency-Key field: an RFC 8941 sf-string, such as
// "8e03978e-40d5-43e8-bc93-6894a57f9324" with its double quotes, in which \"
// and \\ stand for " and \. Since most clients (gRPC's, Stripe's) send the
// key bare, a value that does not start with a double quote is taken as the
// key itself, as long as it holds no double quote, comma or semicolon, which
// would make it a malformed string, a list or a parameter. Both forms of one
// key are one key. Spaces and horizontal tabs (HTAB) around the value are
// dropped first, as HTTP drops the optional whitespace around a field value
// (RFC 9110, section 5.6.3), so that a value in gRPC metadata, where nothing
// drops them, names the key a header does; no other whitespace is dropped.
// Either way the key must then pass ValidateKey. An error is a *KeyError,
// which never quotes the key.
func ParseKey(v string) (string, error) {
	v = strings.Trim(v, " \t")
	if v == "" || v[0] != '"' {
		if strings.ContainsAny(v, "\",;") {
			return "", &KeyError{Problem: "it is neither a structured-field string nor a bare key"}
		}
		return v, ValidateKey(v)
	}
	// An sf-string (RFC 8941, section 4.2.5): DQUOTE *chr DQUOTE, where chr
	// is a printable ASCII character other than " and \, or \" or \\.
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		switch c := v[i]; {
		case c == '\\':
			i++
			if i == len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", &KeyError{Problem: "its string holds a backslash that escapes neither \" nor \\"}
			}
			b.WriteByte(v[i])
		case c == '"':
			if i != len(v)-1 {
				return "", &KeyError{Problem: "something follows its string: a list or parameters"}
			}
			key := b.String()
			return key, ValidateKey(key)
		case c < 0x20 || c > 0x7e:
			return "", &KeyError{Problem: "its string holds a byte outside printable ASCII"}
		default:
			if b.Len() > MaxKeyLen {
				return "", &KeyError{Problem: "it is longer than 255 bytes"}
			}
			b.WriteByte(c)
		}
	}
	return "", &KeyError{Problem: "its string has no closing double quote"}
}

// FormatKey returns the value that carries key in an Idempotency-Key
// header, for a client over HTTP or Connect: the key as an RFC 8941
// sf-string, in double quotes with " and \ escaped, such as
// "8e03978e-40d5-43e8-bc93-6894a57f9324" with its quotes, the form
// draft-ietf-httpapi-idempotency-key-header-07 gives the field. A server
// that reads the field strictly refuses most keys sent bare (a UUID that
// starts with a digit), or reads them as another type (a token, an
// integer); ParseKey, on every entry point, reads either form as the same
// key. In gRPC metadata, where gRPC clients send keys bare, the gRPC client
// interceptor sends a key bare unless ParseKey would read it otherwise. key
// should pass ValidateKey.
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

// NewKey returns a fresh random key: a version 4 UUID from crypto/rand. Keep
// it with the business operation it names, so that a restarted process
// retries with the same key.
func NewKey() string {
	var u [16]byte
	rand.Read(u[:])
	return formatUUID(u, 4)
}

// ContextWithKey returns a context whose calls carry key as their
// idempotency key, for example a key saved with the business record so that
// a restarted process retries the same operation. idemkey's client
// interceptors (interceptor.UnaryClientInterceptor,
// idemconnect.NewClientInterceptor) read it, check it before a call goes out,
// and send it only to the methods they cover; without one, nothing sends
// it. A key the call itself carries (in its metadata or header, in the
// request's key field, or gRPC's interceptor.UseKey) wins. Every covered
// call made with the context carries it, so use one context per operation.
func ContextWithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, clientKey{}, clientContext{key: key})
}

// ContextWithKeyFirstSent is ContextWithKey for a key whose operation was
// first sent at firstSent, which its calls send with the key
// (FirstSentMetadata, FirstSentHeader): a restarted process that saved both
// retries as the first process would have, and the server refuses the retry
// (ReasonKeyExpired) rather than run it again if the key's record may have
// expired. A zero firstSent sends the time of each call.
func ContextWithKeyFirstSent(ctx context.Context, key string, firstSent time.Time) context.Context {
	return context.WithValue(ctx, clientKey{}, clientContext{key: key, firstSent: firstSent})
}

// KeyFromContext returns the key, and the first-sent time, that
// ContextWithKey or ContextWithKeyFirstSent put in ctx, for a client
// interceptor. firstSent is zero unless ContextWithKeyFirstSent gave one.
func KeyFromContext(ctx context.Context) (key string, firstSent time.Time, ok bool) {
	c, ok := ctx.Value(clientKey{}).(clientContext)
	return c.key, c.firstSent, ok
}

type clientKey struct{}

type clientContext struct {
	key       string
	firstSent time.Time
}

// DeriveKey returns the key for a call that one operation makes to another
// idempotent API (a payment provider, another service): a version 8 UUID
// from the SHA-256 of the operation's tenant, name and key, and label, which
// names the downstream call. Every retry of the operation derives the same
// key, so the downstream API deduplicates too; any other tenant, operation,
// key or label derives another. In a handler, DerivedKey fills in the call's
// own parts.
func DeriveKey(tenant, operation, key, label string) string {
	sum := sha256.Sum256(appendParts(make([]byte, 0, 512), "idemkey derived key v1", tenant, operation, key, label))
	return formatUUID([16]byte(sum[:16]), 8)
}

// appendParts appends each part with its length in front, as a big-endian
// uint64, so that parts cannot run together: the encoding of
// store.AppendParts, kept here so that this package imports nothing of the
// module. A derived key leaves the process, so its encoding never changes.
func appendParts(b []byte, parts ...string) []byte {
	for _, p := range parts {
		b = binary.BigEndian.AppendUint64(b, uint64(len(p)))
		b = append(b, p...)
	}
	return b
}

// formatUUID sets the version and the RFC 9562 variant bits of u and formats
// it in the usual 8-4-4-4-12 hex form.
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

// parts are what a call's key is derived from; the handler's context carries
// them for DerivedKey.
type parts struct{ tenant, operation, key string }

// HandlerContext returns ctx carrying the tenant, operation and key of the
// call a handler runs for, which DerivedKey reads. The engine calls it for
// every entry point; an adapter author has no need to.
func HandlerContext(ctx context.Context, tenant, operation, key string) context.Context {
	return &partsContext{ctx, parts{tenant, operation, key}}
}

type partsKey struct{}

// partsContext is ctx carrying a call's parts: one allocation per call, where
// context.WithValue would take two (its context, and the parts boxed).
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

// DerivedKey returns the idempotency key for a call that the handler of ctx
// makes to another idempotent API, labelled by label: DeriveKey of the call's
// tenant, operation and key, on every entry point (gRPC, Connect, HTTP, a
// message consumer). ok is false if ctx is not the handler context of a call
// with a key.
func DerivedKey(ctx context.Context, label string) (key string, ok bool) {
	p, ok := ctx.Value(partsKey{}).(*parts)
	if !ok {
		return "", false
	}
	return DeriveKey(p.tenant, p.operation, p.key, label), true
}
