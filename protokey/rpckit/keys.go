package rpckit

import (
	"context"
	"errors"
	"log/slog"
	"time"

	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/store"
)

// GetKeyProcedure is the full name of idemkey.v1.KeyService's GetKey:
// "/idemkey.v1.KeyService/GetKey". idemkey.v1 has no generated service
// code, which would build grpc-go into every package that reads its
// messages; each adapter describes the service itself.
const GetKeyProcedure = "/idemkey.v1.KeyService/GetKey"

// KeyAnswer is the answer to idemkey.v1.KeyService's GetKey, as an adapter
// sends it: Response, with the replayed metadata of a completed key's
// record (Header, Trailer) and its expiry; or Status, idemkey's refusal; or
// Err, the tenant function's, sent as it is.
type KeyAnswer struct {
	Response        *idemkeyv1.GetKeyResponse
	Header, Trailer []*idemkeyv1.MetadataEntry
	Expires         time.Time // zero if unknown
	Status          *idemkeyv1.Status
	Err             error
}

// errNotCovered refuses a GetKey of an operation whose keys are not kept.
var errNotCovered = &idemkeyv1.Status{Code: int32(rpccode.Code_INVALID_ARGUMENT),
	Message: []byte("the operation is not one that idempotency keys are kept for on this server: a method it serves and covers, \"/package.Service/Method\"")}

var errFingerprint = &idemkeyv1.Status{Code: int32(rpccode.Code_INVALID_ARGUMENT),
	Message: []byte("the fingerprint must be empty or 32 bytes: SHA-256 of the operation and the request's canonical form")}

// GetKey answers req on a server of ms (NewMethods with its engine, eng)
// that replays the metadata named in replayed; firstSent and firstRegion
// are the values of the call's first-sent and first-region fields. An operation that ms does not cover, or the
// registry does not know, is InvalidArgument: its keys are never kept.
func (ms *Methods) GetKey(ctx context.Context, eng *engine.Engine, req *idemkeyv1.GetKeyRequest, firstSent, firstRegion []string, replayed map[string]bool) KeyAnswer {
	m := ms.Find(req.GetOperation())
	if m == nil || !m.Covered {
		return KeyAnswer{Status: errNotCovered}
	}
	var fp store.Fingerprint
	switch len(req.GetFingerprint()) {
	case 0, len(fp):
		copy(fp[:], req.GetFingerprint())
	default:
		return KeyAnswer{Status: errFingerprint}
	}
	ks, err := eng.Lookup(ctx, m.Op, req.GetKey(), firstSent, firstRegion...)
	if err != nil {
		return lookupRefusal(ctx, err)
	}
	if fp != (store.Fingerprint{}) && (ks.State == engine.KeyCompleted || ks.State == engine.KeyInProgress) && !ks.MadeFor(fp) {
		// Another request's record: never its outcome, nor its expiry.
		return KeyAnswer{Response: &idemkeyv1.GetKeyResponse{State: idemkeyv1.GetKeyResponse_STATE_REUSED, StepsDone: ks.StepsDone}}
	}
	a := KeyAnswer{Response: &idemkeyv1.GetKeyResponse{StepsDone: ks.StepsDone}, Expires: ks.Expires}
	resp := a.Response
	if !ks.Expires.IsZero() {
		resp.ExpireTime = timestamppb.New(ks.Expires)
	}
	switch ks.State {
	case engine.KeyUnknown:
		resp.State = idemkeyv1.GetKeyResponse_STATE_UNKNOWN
	case engine.KeyExpired:
		resp.State = idemkeyv1.GetKeyResponse_STATE_EXPIRED
	case engine.KeyInProgress:
		resp.State, resp.RetryAfter = idemkeyv1.GetKeyResponse_STATE_IN_PROGRESS, durationpb.New(ks.RetryAfter)
	case engine.KeyCompleted:
		resp.State = idemkeyv1.GetKeyResponse_STATE_COMPLETED
		rec, st := m.Read(ctx, eng.Logger(), ks.Outcome)
		switch {
		case st != nil: // a record that cannot be read: what a retry gets
			resp.Status = st
		case rec.Status != nil:
			resp.Status = rec.Status
		default:
			resp.Status = &idemkeyv1.Status{}
			if resp.Response, err = anypb.New(rec.Response); err != nil {
				eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: recorded response cannot be read",
					slog.String("operation", m.Name), slog.Any("error", err))
				resp.Status = Internal("idemkey: the recorded outcome of this call cannot be read")
			}
		}
		if st == nil {
			a.Header, a.Trailer = Allowed(rec.Header, replayed), Allowed(rec.Trailer, replayed)
		}
	}
	return a
}

// lookupRefusal is the answer of engine.Lookup's error.
func lookupRefusal(ctx context.Context, err error) KeyAnswer {
	var fsErr *engine.FirstSentError
	switch {
	case errors.As(err, new(*idemkey.KeyError)):
		return KeyAnswer{Status: InvalidKey(err)}
	case errors.As(err, &fsErr):
		return KeyAnswer{Status: Refusal(ctx, engine.Answer{Verdict: engine.FirstSentInvalid, Err: err}, "")}
	case errors.Is(err, errors.ErrUnsupported):
		return KeyAnswer{Status: &idemkeyv1.Status{Code: int32(rpccode.Code_UNIMPLEMENTED),
			Message: []byte("idemkey: this server's idempotency store cannot look keys up")}}
	case errors.Is(err, store.ErrUnavailable), errors.Is(err, store.ErrDataLost):
		return KeyAnswer{Status: Refusal(ctx, engine.Answer{Verdict: engine.StoreUnavailable}, "")}
	}
	return KeyAnswer{Err: err} // the tenant function's, as a call gets it
}
