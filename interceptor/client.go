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

// UnaryClientInterceptor returns a client interceptor that gives every call
// of a covered method an idempotency key and first-sent time: the caller's
// own (UseKey, idemkey.ContextWithKey, the metadata) or else a new key and
// now; and the first region the caller gives with its key
// (UseKeyFirstRegion, idemkey.ContextWithKeyFirstRegion, the metadata). A
// malformed key or region fails the call with InvalidArgument before it is
// sent.
// It returns an error if a MethodOption names a method the protobuf registry
// does not know.
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
		var (
			err      error
			supplied string // the caller's own key, for WithLookupFirst
		)
		if used {
			ctx, err = withUsedKey(ctx, use)
			supplied = use.key
		} else {
			ctx, supplied, err = withKey(ctx, m, req)
		}
		if err != nil {
			return err
		}
		if cov.LookupFirst > 0 && supplied != "" {
			if done, err := lookupFirst(ctx, cov.LookupFirst, m, supplied, req, reply, cc, expiry); done {
				return err
			}
		}
		return expiry.invoke(ctx, fullMethod, req, reply, cc, invoker, callOpts)
	}, nil
}

func withUsedKey(ctx context.Context, use keyOption) (context.Context, error) {
	if err := validateKey(use.key); err != nil {
		return nil, err
	}
	kv := []string{idemkey.KeyMetadata, metadataKey(use.key), idemkey.FirstSentMetadata, formatFirstSent(use.firstSent)}
	if use.region != "" {
		if problem := rpckit.FirstRegionProblem(use.region, !use.firstSent.IsZero()); problem != "" {
			return nil, firstRegionInvalidError(problem)
		}
		kv = append(kv, idemkey.FirstRegionMetadata, use.region)
	}
	return metadata.AppendToOutgoingContext(withoutKey(ctx), kv...), nil
}

// withKey keeps the metadata's key and first-sent time, checked (an
// obsolete HTTP date form goes as IMF-fixdate), else adds the context's or
// new ones. supplied is the caller's key, from the metadata or the context;
// "" for a new one or a request's key field.
func withKey(ctx context.Context, m *rpckit.Method, req any) (_ context.Context, supplied string, err error) {
	md, _ := metadata.FromOutgoingContext(ctx) // a copy
	key, firstSent, fromContext := idemkey.KeyFromContext(ctx)
	region := idemkey.FirstRegionFromContext(ctx)
	switch {
	case len(md[idemkey.KeyMetadata]) > 0 || carriesKey(m, req):
		if supplied, _, err = keyFromMetadata(md); err != nil {
			return nil, "", err
		}
		key, firstSent, region = "", time.Time{}, "" // the context's time and region are for the context's key
	case fromContext:
		if err := validateKey(key); err != nil {
			return nil, "", err
		}
		supplied, key = key, metadataKey(key)
	default:
		key = idemkey.NewKey()
	}
	timed := len(md[idemkey.FirstSentMetadata]) > 0 || !firstSent.IsZero() // else sent as now
	switch sent := md[idemkey.FirstSentMetadata]; len(sent) {
	case 0:
		ctx = metadata.AppendToOutgoingContext(ctx, idemkey.FirstSentMetadata, formatFirstSent(firstSent))
	case 1:
		t, err := idemkey.ParseDate(sent[0])
		if err != nil {
			return nil, "", firstSentInvalidError("it is not an HTTP date")
		}
		if v := idemkey.FormatDate(t); v != sent[0] {
			md.Set(idemkey.FirstSentMetadata, v)
			ctx = metadata.NewOutgoingContext(ctx, md)
		}
	default:
		return nil, "", firstSentInvalidError("it was sent more than once")
	}
	switch vs := md[idemkey.FirstRegionMetadata]; len(vs) {
	case 0:
		if region != "" {
			if problem := rpckit.FirstRegionProblem(region, timed); problem != "" {
				return nil, "", firstRegionInvalidError(problem)
			}
			ctx = metadata.AppendToOutgoingContext(ctx, idemkey.FirstRegionMetadata, region)
		}
	case 1:
		if problem := rpckit.FirstRegionProblem(vs[0], timed); problem != "" {
			return nil, "", firstRegionInvalidError(problem)
		}
	default:
		return nil, "", firstRegionInvalidError("it was sent more than once")
	}
	if key != "" { // after the metadata is replaced, if it was
		ctx = metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, key)
	}
	return ctx, supplied, nil
}

func carriesKey(m *rpckit.Method, req any) bool {
	msg, ok := req.(proto.Message)
	return ok && m.KeyField != nil && protokey.KeyFromField(msg, m.KeyField) != ""
}

// UseKey is a call option that sends key as the call's idempotency key, for
// example one saved with the business record. It needs
// UnaryClientInterceptor: without it the call goes out with no key, silently.
func UseKey(key string) grpc.CallOption {
	return keyOption{key: key}
}

// UseKeyFirstSent is UseKey for an operation first sent at firstSent (zero:
// now): a server refuses a retry later than it keeps keys rather than run it.
func UseKeyFirstSent(key string, firstSent time.Time) grpc.CallOption {
	return keyOption{key: key, firstSent: firstSent}
}

// UseKeyFirstRegion is UseKeyFirstSent for an operation first sent to
// region (idemkey.FirstRegionMetadata; "" sends none), for a client that
// fails over to another region with a saved key: a server of another
// region (engine.WithRegion) runs nothing until the first region's record
// reaches it, so the key runs in one region only. A region that is not a
// region name (idemkey.ValidateRegion), or a region with a zero firstSent,
// fails the call with InvalidArgument before it is sent.
func UseKeyFirstRegion(key string, firstSent time.Time, region string) grpc.CallOption {
	return keyOption{key: key, firstSent: firstSent, region: region}
}

// keyOption is UseKey's call option. It is not per-call credentials, which
// work without the interceptor: gRPC keeps one set per call, so the key
// would displace the caller's own credentials, or they the key.
type keyOption struct {
	grpc.EmptyCallOption
	key       string
	firstSent time.Time // zero: now
	region    string    // "": none
}

func formatFirstSent(t time.Time) string {
	if t.IsZero() {
		t = time.Now()
	}
	return idemkey.FormatDate(t)
}

// lastOption returns the last T among callOpts, and callOpts without any.
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

// metadataKey is key bare if idemkey.ParseKey reads it back so, else quoted.
func metadataKey(key string) string {
	if v, err := idemkey.ParseKey(key); err == nil && v == key {
		return key
	}
	return idemkey.FormatKey(key)
}

func withoutKey(ctx context.Context) context.Context {
	md, ok := metadata.FromOutgoingContext(ctx)
	if !ok || len(md[idemkey.KeyMetadata]) == 0 && len(md[idemkey.FirstSentMetadata]) == 0 && len(md[idemkey.FirstRegionMetadata]) == 0 {
		return ctx
	}
	delete(md, idemkey.KeyMetadata) // md is a copy
	delete(md, idemkey.FirstSentMetadata)
	delete(md, idemkey.FirstRegionMetadata)
	return metadata.NewOutgoingContext(ctx, md)
}

// KeyExpiry is a call option that sets *dst, once the call ends, to the
// instant until which the server honours the call's key; zero if it did not
// say. It needs UnaryClientInterceptor.
func KeyExpiry(dst *time.Time) grpc.CallOption {
	return expiryOption{dst: dst}
}

type expiryOption struct {
	grpc.EmptyCallOption
	dst *time.Time
}

func keyExpiry(callOpts []grpc.CallOption) (expiryOption, []grpc.CallOption) {
	e, rest, _ := lastOption[expiryOption](callOpts)
	if e.dst != nil {
		*e.dst = time.Time{}
	}
	return e, rest
}

func (e expiryOption) invoke(ctx context.Context, fullMethod string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts []grpc.CallOption) error {
	if e.dst == nil {
		return invoker(ctx, fullMethod, req, reply, cc, callOpts...)
	}
	var header, trailer metadata.MD
	err := invoker(ctx, fullMethod, req, reply, cc, append(callOpts, grpc.Header(&header), grpc.Trailer(&trailer))...)
	*e.dst, _ = keyExpires(header, trailer)
	return err
}

// keyExpires returns the expiry in the first of mds that carries one; ok is
// false unless it is one HTTP date.
func keyExpires(mds ...metadata.MD) (expires time.Time, ok bool) {
	for _, md := range mds {
		if v := md.Get(idemkey.ExpiresMetadata); len(v) > 0 {
			return idemkey.ParseExpires(v)
		}
	}
	return time.Time{}, false
}
