package interceptor

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/protokey/rpckit"
)

// WithLookupFirst makes the client interceptor ask the server what became of
// a key (idemkey.v1.KeyService's GetKey, on the same connection) before it
// sends a request of at least minBytes bytes that carries a key the caller
// supplied (UseKey, idemkey.ContextWithKey, or the metadata): a retry of a
// large request whose reply was lost then costs a small round trip, not
// the request's bytes. A completed key is answered from the record, the
// reply or the recorded error, without sending the request; in any other
// state, or if GetKey fails (a server without the KeyService answers
// Unimplemented), the request is sent as it would have been. A reply
// answered so is the recorded one, as a retry would get it, but the call's
// grpc.Header and grpc.Trailer options get no metadata; KeyExpiry gets the
// key's expiry. minBytes of 0 or less turns it off. It is a MethodOption so
// that UnaryClientInterceptor takes it, but a client's setting alone:
// UnaryServerInterceptor and RegisterKeyService refuse it.
func WithLookupFirst(minBytes int) MethodOption {
	return methodOption(func(c *rpckit.Coverage) { c.LookupFirst = max(minBytes, 0) })
}

// lookupFirst asks for key's state before a call of m with req of at
// least minBytes, and answers the call from a completed key's record made
// for req: done reports that it did, with err the call's error. GetKey is
// given req's fingerprint as a server makes it by default, so that a key
// reused with another request is never answered with that one's outcome
// (STATE_REUSED: the request goes, and the server refuses it).
func lookupFirst(ctx context.Context, minBytes int, m *rpckit.Method, key string, req, reply any, cc *grpc.ClientConn, expiry expiryOption) (done bool, err error) {
	msg, ok := req.(proto.Message)
	out, okReply := reply.(proto.Message)
	if !ok || !okReply || proto.Size(msg) < minBytes {
		return false, nil
	}
	fp, st, _ := m.Fingerprint(ctx, nil, req, nil, nil) // the default fingerprint: no function, no log
	if st != nil {
		return false, nil
	}
	// GetKey carries the call's first-sent time, so that a key refused as
	// expired is told so, but not the key as metadata: GetKey is no keyed call.
	md, _ := metadata.FromOutgoingContext(ctx)
	delete(md, idemkey.KeyMetadata) // md is a copy
	resp := new(idemkeyv1.GetKeyResponse)
	if err := cc.Invoke(metadata.NewOutgoingContext(ctx, md), rpckit.GetKeyProcedure,
		&idemkeyv1.GetKeyRequest{Operation: m.Name, Key: key, Fingerprint: fp[:]}, resp); err != nil {
		return false, nil // the request is sent; its own answer tells
	}
	if resp.GetState() != idemkeyv1.GetKeyResponse_STATE_COMPLETED {
		return false, nil
	}
	if st := resp.GetStatus(); st.GetCode() != 0 {
		err = toError(st)
	} else if err = resp.GetResponse().UnmarshalTo(out); err != nil {
		return false, nil // not this method's reply: let the server answer
	}
	if expiry.dst != nil && resp.GetExpireTime() != nil {
		*expiry.dst = resp.GetExpireTime().AsTime()
	}
	return true, err
}
