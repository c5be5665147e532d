package interceptor

import (
	"sync/atomic"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
)

// trailers keeps the last minute's expiry trailers, one per second, made once
// a second rather than once a call. gRPC copies a trailer; a kept one is
// never modified.
type trailers [64]atomic.Pointer[expiryTrailers]

type expiryTrailers struct {
	unix   int64       // the expiry's time.Time.Unix
	expiry metadata.MD // idemkey.ExpiresMetadata
	first  metadata.MD // the same, with idemkey.ReplayedMetadata "false"
	replay metadata.MD // the same, with idemkey.ReplayedMetadata "true"
}

func (t *trailers) of(expires time.Time) *expiryTrailers {
	unix := expires.Unix()
	if e := t[uint64(unix)%uint64(len(t))].Load(); e != nil && e.unix == unix {
		return e
	}
	return nil
}

func (t *trailers) keep(expires time.Time) *expiryTrailers {
	unix := expires.Unix()
	value := []string{idemkey.FormatDate(expires)}
	e := &expiryTrailers{
		unix:   unix,
		expiry: metadata.MD{idemkey.ExpiresMetadata: value},
		first:  metadata.MD{idemkey.ExpiresMetadata: value, idemkey.ReplayedMetadata: firstValue},
		replay: metadata.MD{idemkey.ExpiresMetadata: value, idemkey.ReplayedMetadata: replayedValue},
	}
	t[uint64(unix)%uint64(len(t))].Store(e)
	return e
}

// The fates' values and trailers, never modified.
var (
	replayedValue   = []string{"true"}
	replayedTrailer = metadata.MD{idemkey.ReplayedMetadata: replayedValue}
	firstValue      = []string{"false"}
	firstTrailer    = metadata.MD{idemkey.ReplayedMetadata: firstValue}
	ignoredTrailer  = metadata.MD{idemkey.StatusMetadata: {idemkey.StatusIgnored}}
)
