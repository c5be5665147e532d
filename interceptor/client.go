package interceptor

import (
	"context"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/protokey"
	"github.com/idemkey/idemkey/protokey/rpckit"
)

// UnaryClientInterceptor returns a client interceptor that attaches an
// idempotency key to every call of a covered method that carries none: the
// caller's own (UseKey, idemkey.ContextWithKey, or the metadata itself) or else a
// fresh idemkey.NewKey. A caller's key that is malformed fails the call with
// InvalidArgument before it is sent. UseKey wins over a key in the context.
//
// With the key it sends when the key's operation was first sent
// (idemkey.FirstSentMetadata), so that a server can refuse a retry that
// comes after the key's record may have expired rather than run it again:
// the time UseKeyFirstSent or idemkey.ContextWithKeyFirstSent gave, or one already
// in the metadata (checked like a key), or else now.
//
// gRPC runs the retries of its service-config retry policy below all
// interceptors, so every attempt of one call carries the same key and
// first-sent time. A retry loop of your own must run inside this interceptor
// (a retry interceptor chained after it), or reuse one key through UseKey or
// idemkey.ContextWithKey; otherwise each attempt gets a key of its own. Such a loop,
// or a process that retries after a restart, should also store the first
// attempt's time with the key and pass it with UseKeyFirstSent or
// idemkey.ContextWithKeyFirstSent: otherwise each call sends its own time, and a
// retry too late to be safe is run rather than refused.
//
// Like UnaryServerInterceptor, it returns an error if WithIncludedMethods or
// WithExcludedMethods names a method the protobuf registry does not know.
func UnaryClientInterceptor(opts ...MethodOption) (grpc.UnaryClientInterceptor, error) {
	var cov rpckit.Coverage
	for _, opt := range opts {
		opt.applyClient(&cov)
	}
	if err := rpckit.Check(cov, naming, false, nil); err != nil {
		return nil, err
	}
	ms := rpckit.NewMethods(cov, nil, "")
	return func(ctx context.Context, fullMethod string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		expiry, callOpts := keyExpiry(callOpts)
		use, callOpts, used := lastOption[keyOption](callOpts)
		m := ms.Get(fullMethod, nil, false)
		if !m.Covered { // UseKey's and idemkey.ContextWithKey's keys are for covered methods
			return invoker(ctx, fullMethod, req, reply, cc, callOpts...)
		}
		var err error
		if used {
			ctx, err = withUsedKey(ctx, use)
		} else {
			ctx, err = withKey(ctx, m, req)
		}
		if err != nil {
			return err
		}
		return expiry.invoke(ctx, fullMethod, req, reply, cc, invoker, callOpts)
	}, nil
}

// withUsedKey is ctx with UseKey's key and first-sent time in its outgoing
// metadata, in place of any there.
func withUsedKey(ctx context.Context, use keyOption) (context.Context, error) {
	if err := validateKey(use.key); err != nil {
		return nil, err
	}
	return metadata.AppendToOutgoingContext(withoutKey(ctx), idemkey.KeyMetadata, metadataKey(use.key),
		idemkey.FirstSentMetadata, formatFirstSent(use.firstSent)), nil
}

// withKey is ctx with the call's key and first-sent time in its outgoing
// metadata: those already there, checked, or else those of
// idemkey.ContextWithKey, or else a new key and now. A first-sent time there
// in an obsolete form of HTTP date goes as the IMF-fixdate of its time.
func withKey(ctx context.Context, m *rpckit.Method, req any) (context.Context, error) {
	md, _ := metadata.FromOutgoingContext(ctx) // a copy
	key, firstSent, fromContext := idemkey.KeyFromContext(ctx)
	switch {
	case len(md[idemkey.KeyMetadata]) > 0 || carriesKey(m, req):
		if _, _, err := keyFromMetadata(md); err != nil {
			return nil, err
		}
		key, firstSent = "", time.Time{} // the context's time is for the context's key
	case fromContext:
		if err := validateKey(key); err != nil {
			return nil, err
		}
		key = metadataKey(key)
	default:
		key = idemkey.NewKey()
	}
	switch sent := md[idemkey.FirstSentMetadata]; len(sent) {
	case 0:
		ctx = metadata.AppendToOutgoingContext(ctx, idemkey.FirstSentMetadata, formatFirstSent(firstSent))
	case 1:
		t, err := idemkey.ParseDate(sent[0])
		if err != nil {
			return nil, firstSentInvalidError("it is not an HTTP date")
		}
		if v := idemkey.FormatDate(t); v != sent[0] {
			md.Set(idemkey.FirstSentMetadata, v)
			ctx = metadata.NewOutgoingContext(ctx, md)
		}
	default:
		return nil, firstSentInvalidError("it was sent more than once")
	}
	if key != "" { // after the metadata is replaced, if it was
		ctx = metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, key)
	}
	return ctx, nil
}

// carriesKey reports whether req carries its own key in m's key field
// (WithKeyField).
func carriesKey(m *rpckit.Method, req any) bool {
	msg, ok := req.(proto.Message)
	return ok && m.KeyField != nil && protokey.KeyFromField(msg, m.KeyField) != ""
}

// UseKey is a call option that sends key as the call's idempotency key, for
// example one saved with the business record so that a restarted process
// retries the same operation. UnaryClientInterceptor reads it, checks the
// key before the call goes out and sends it in the metadata, beside any
// per-call credentials of the caller's own, on every attempt of the call;
// it sends none to a method it does not cover. It needs the interceptor: on
// a connection without it, gRPC ignores the option and the call goes out
// with no key, silently, so that the server runs it unprotected or refuses
// it (WithKeyRequired). Put the key in the outgoing metadata there
// (idemkey.KeyMetadata, idemkey.FormatKey).
//
// The interceptor sends now as the key's first-sent time: a retry of an
// operation sent before should use UseKeyFirstSent.
func UseKey(key string) grpc.CallOption {
	return keyOption{key: key}
}

// UseKeyFirstSent is UseKey for a key whose operation was first sent at
// firstSent (idemkey.FirstSentMetadata): the time of its first attempt,
// saved with the key, so that a server refuses a retry that comes later
// than it keeps keys (FailedPrecondition, IDEMPOTENCY_KEY_EXPIRED) rather
// than run it again. A zero firstSent is now. Like UseKey, it needs
// UnaryClientInterceptor.
func UseKeyFirstSent(key string, firstSent time.Time) grpc.CallOption {
	return keyOption{key: key, firstSent: firstSent}
}

// keyOption is the call option of UseKey and UseKeyFirstSent, which only
// the interceptor reads. It is not made of per-call credentials, which gRPC
// would send without the interceptor too: gRPC keeps one set per call, so
// the key would displace the caller's own credentials, or they the key.
type keyOption struct {
	grpc.EmptyCallOption
	key       string
	firstSent time.Time // zero: now
}

// formatFirstSent is t as the first-sent metadata's value; now if t is zero.
func formatFirstSent(t time.Time) string {
	if t.IsZero() {
		t = time.Now()
	}
	return idemkey.FormatDate(t)
}

// lastOption returns the last option of type T among callOpts, and callOpts
// without those of type T: the interceptor's own, which it takes out before
// gRPC sees them.
func lastOption[T grpc.CallOption](callOpts []grpc.CallOption) (last T, rest []grpc.CallOption, ok bool) {
	if !slices.ContainsFunc(callOpts, func(o grpc.CallOption) bool { _, is := o.(T); return is }) {
		return last, callOpts, false // no copy
	}
	for _, o := range callOpts {
		if t, is := o.(T); is {
			last = t
			continue
		}
		rest = append(rest, o)
	}
	return last, rest, true
}

// metadataKey is the value that carries key in gRPC metadata: the key
// itself, as gRPC clients send keys, when idemkey.ParseKey reads it back
// unchanged (as it does every key idemkey.NewKey makes), else the
// sf-string of idemkey.FormatKey.
func metadataKey(key string) string {
	if v, err := idemkey.ParseKey(key); err == nil && v == key {
		return key
	}
	return idemkey.FormatKey(key)
}

// withoutKey is ctx with no idempotency key, nor first-sent time, in its
// outgoing metadata.
func withoutKey(ctx context.Context) context.Context {
	md, ok := metadata.FromOutgoingContext(ctx)
	if !ok || len(md[idemkey.KeyMetadata]) == 0 && len(md[idemkey.FirstSentMetadata]) == 0 {
		return ctx
	}
	delete(md, idemkey.KeyMetadata) // md is a copy
	delete(md, idemkey.FirstSentMetadata)
	return metadata.NewOutgoingContext(ctx, md)
}

// KeyExpiry is a call option that sets *dst, once the call ends, to the
// instant until which the server honours the call's key
// (idemkey.ExpiresMetadata, from the header or trailer): a retry after it
// may run the operation again, or be refused. *dst is zero if the server did
// not say: no key, a key released or never recorded, a server that does not
// tell. It needs UnaryClientInterceptor, which reads and removes it; other
// grpc.Header and grpc.Trailer options of the call still get the metadata.
func KeyExpiry(dst *time.Time) grpc.CallOption {
	return expiryOption{dst: dst}
}

type expiryOption struct {
	grpc.EmptyCallOption
	dst *time.Time
}

// keyExpiry returns the last KeyExpiry among callOpts, with its *dst
// zeroed, and callOpts without KeyExpiry options.
func keyExpiry(callOpts []grpc.CallOption) (expiryOption, []grpc.CallOption) {
	e, rest, _ := lastOption[expiryOption](callOpts)
	if e.dst != nil {
		*e.dst = time.Time{}
	}
	return e, rest
}

// invoke makes the call, and then sets *e.dst from its header or trailer.
func (e expiryOption) invoke(ctx context.Context, fullMethod string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts []grpc.CallOption) error {
	if e.dst == nil {
		return invoker(ctx, fullMethod, req, reply, cc, callOpts...)
	}
	var header, trailer metadata.MD
	err := invoker(ctx, fullMethod, req, reply, cc, append(callOpts, grpc.Header(&header), grpc.Trailer(&trailer))...)
	*e.dst, _ = keyExpires(header, trailer)
	return err
}

// keyExpires returns the key's expiry that a server sent in mds (a call's
// header and trailer: idemkey.ExpiresMetadata). The first of mds that
// carries the field decides: ok is false unless it is one HTTP date.
func keyExpires(mds ...metadata.MD) (expires time.Time, ok bool) {
	for _, md := range mds {
		if v := md.Get(idemkey.ExpiresMetadata); len(v) > 0 {
			return idemkey.ParseExpires(v)
		}
	}
	return time.Time{}, false
}
