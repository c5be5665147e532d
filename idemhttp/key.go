package idemhttp

import (
	"net/http"

	"github.com/idemkey/idemkey"
)

// KeyFromHeader returns the idempotency key of h, read by idemkey.ParseKey;
// ok is false if h has none. err, an *idemkey.KeyError that never quotes the
// key, is set if the field is malformed or sent more than once.
func KeyFromHeader(h http.Header) (key string, ok bool, err error) {
	values := h[idemkey.KeyHeader] // canonical, as Values would make it
	switch len(values) {
	case 0:
		return "", false, nil
	case 1:
	default:
		return "", true, &idemkey.KeyError{Problem: "the Idempotency-Key field is sent more than once"}
	}
	key, err = idemkey.ParseKey(values[0])
	if err != nil {
		return "", true, err
	}
	return key, true, nil
}
