package idemkey

import (
	"errors"
	"time"
)

// dateLayout is the IMF-fixdate of RFC 9110, section 5.6.7: an HTTP date.
const dateLayout = "Mon, 02 Jan 2006 15:04:05 GMT"

// FormatDate returns t as an HTTP date (IMF-fixdate), the form of
// ExpiresHeader and FirstSentHeader on every transport, such as
// "Tue, 01 Dec 2026 20:05:37 GMT". It has whole seconds: t is truncated.
func FormatDate(t time.Time) string { return t.UTC().Format(dateLayout) }

// ErrDate is ParseDate's error: the value is not an IMF-fixdate.
var ErrDate = errors.New("idemkey: not an HTTP date (IMF-fixdate, such as \"Tue, 01 Dec 2026 20:05:37 GMT\")")

// ParseDate reads an HTTP date written as FormatDate writes it. The
// obsolete forms net/http also accepts (RFC 850, asctime) are refused: a
// client that sends FirstSentHeader writes it with a current library.
func ParseDate(v string) (time.Time, error) {
	t, err := time.Parse(dateLayout, v)
	if err != nil {
		return time.Time{}, ErrDate
	}
	return t, nil
}

// ParseExpires reads the key's expiry from the values of an ExpiresHeader
// or ExpiresMetadata field, as a client gets them: ok is false unless there
// is exactly one, an HTTP date. Over HTTP and Connect, a client reads a
// response's (or a Connect error's Meta()):
//
//	expires, ok := idemkey.ParseExpires(h.Values(idemkey.ExpiresHeader))
//
// over gRPC, interceptor.KeyExpiry, or from a trailer of the caller's own:
//
//	expires, ok := idemkey.ParseExpires(trailer.Get(idemkey.ExpiresMetadata))
func ParseExpires(values []string) (t time.Time, ok bool) {
	if len(values) != 1 {
		return time.Time{}, false
	}
	t, err := ParseDate(values[0])
	return t, err == nil
}
