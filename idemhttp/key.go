package idemhttp

import (
	"net/http"
	"strings"

	"github.com/idemkey/idemkey"
)

// KeyFromHeader returns the idempotency key of h. ok is false if h has no
// Idempotency-Key field. err, an *idemkey.KeyError that never quotes the key,
// is set if the field is malformed or sent more than once.
//
// The draft defines the field as an RFC 8941 sf-string, such as
// "8e03978e-40d5-43e8-bc93-6894a57f9324" with its double quotes, in which \"
// and \\ stand for " and \. Since many clients (Stripe's among them) send the
// key bare, a value that does not start with a double quote is taken as the
// key itself, as long as it holds no double quote, comma or semicolon, which
// would make it a malformed string, a list or a parameter. Both forms of one
// key are one key. Parameters after a string (;a=1) are refused: the draft
// defines none. Either way, the key must then pass idemkey.ValidateKey: 1 to 255
// bytes of visible ASCII.
func KeyFromHeader(h http.Header) (key string, ok bool, err error) {
	values := h.Values(idemkey.KeyHeader)
	switch len(values) {
	case 0:
		return "", false, nil
	case 1:
	default:
		return "", true, &idemkey.KeyError{Problem: "the Idempotency-Key field is sent more than once"}
	}
	key, err = idemkey.ParseKeyField(values[0])
	if err != nil {
		return "", true, err
	}
	return key, true, nil
}

// FormatKey returns key as an sf-string field value, for a client's
// Idempotency-Key header: in double quotes, with " and \ escaped. key should
// pass idemkey.ValidateKey.
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
