package interceptor

import (
	"sync/atomic"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
)

// trailers keeps the trailers that tell the expiries of the last minute's
// first calls, to the second. Every first call of one second tells the same
// expiry, and so does every replay of its key, which a retry soon asks for:
// each is made once a second rather than once a call. gRPC copies a trailer
// it is set (metadata.Join); a kept one is never modified.
type trailers [64]atomic.Pointer[expiryTrailers]

// expiryTrailers are the trailers of one second's expiry.
type expiryTrailers struct {
	unix   int64       // the expiry's time.Time.Unix
	expiry metadata.MD // idemkey.ExpiresMetadata
	replay metadata.MD // the same, with idemkey.ReplayedMetadata
}

// of returns the kept trailers of expires; nil if none are kept.
func (t *trailers) of(expires time.Time) *expiryTrailers {
	unix := expires.Unix()
	if e := t[uint64(unix)%uint64(len(t))].Load(); e != nil && e.unix == unix {
		return e
	}
	return nil
}

// keep makes the trailers of expires, a first call's, and keeps them in
// place of an older second's.
func (t *trailers) keep(expires time.Time) *expiryTrailers {
	unix := expires.Unix()
	value := []string{idemkey.FormatDate(expires)}
	e := &expiryTrailers{
		unix:   unix,
		expiry: metadata.MD{idemkey.ExpiresMetadata: value},
		replay: metadata.MD{idemkey.ExpiresMetadata: value, idemkey.ReplayedMetadata: replayedValue},
	}
	t[uint64(unix)%uint64(len(t))].Store(e)
	return e
}

// replayedValue is the value of idemkey.ReplayedMetadata, and
// replayedTrailer a replay's trailer without an expiry. gRPC copies a
// trailer's values; they are never modified.
var (
	replayedValue   = []string{"true"}
	replayedTrailer = metadata.MD{idemkey.ReplayedMetadata: replayedValue}
)
