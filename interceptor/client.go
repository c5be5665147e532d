package interceptor

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/protokey"
)

// UnaryClientInterceptor returns a client interceptor that attaches an
// idempotency key to every call of a covered method that carries none: the
// caller's own (UseKey, ContextWithKey, or the metadata itself) or else a
// fresh idemkey.NewKey. A caller's key that is malformed fails the call with
// InvalidArgument before it is sent. UseKey wins over a key in the context.
//
// gRPC runs the retries of its service-config retry policy below all
// interceptors, so every attempt of one call carries the same key. A retry
// loop of your own must run inside this interceptor (a retry interceptor
// chained after it), or reuse one key through UseKey or ContextWithKey;
// otherwise each attempt gets a key of its own.
//
// Like UnaryServerInterceptor, it returns an error if WithIncludedMethods or
// WithExcludedMethods names a method the protobuf registry does not know.
func UnaryClientInterceptor(opts ...ClientOption) (grpc.UnaryClientInterceptor, error) {
	o := newClientOptions(opts)
	if err := checkMethods(o); err != nil {
		return nil, err
	}
	ms := &methods{opts: o}
	return func(ctx context.Context, fullMethod string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		m := ms.get(fullMethod)
		if !m.covered {
			if ctx.Value(contextKeyMarker{}) != nil { // ContextWithKey's key is for covered methods
				ctx = withoutKey(ctx)
			}
			return invoker(ctx, fullMethod, req, reply, cc, callOpts...)
		}
		if key, rest, ok := useKey(callOpts); ok {
			if err := validateKey(key); err != nil {
				return err
			}
			// The key goes in the metadata, in place of any other there, and
			// UseKey's credentials go, so that per-call credentials of the
			// caller's own are not displaced by them.
			ctx = metadata.AppendToOutgoingContext(withoutKey(ctx), idemkey.KeyMetadata, idemkey.FormatKey(key))
			return invoker(ctx, fullMethod, req, reply, cc, rest...)
		}
		md, _ := metadata.FromOutgoingContext(ctx)
		if keys := md[idemkey.KeyMetadata]; len(keys) > 0 || carriesKey(m, req) {
			if _, _, err := KeyFromMetadata(md); err != nil {
				return err
			}
			return invoker(ctx, fullMethod, req, reply, cc, callOpts...)
		}
		ctx = metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, idemkey.NewKey())
		return invoker(ctx, fullMethod, req, reply, cc, callOpts...)
	}, nil
}

// carriesKey reports whether req carries its own key in m's key field
// (WithKeyField).
func carriesKey(m *method, req any) bool {
	msg, ok := req.(proto.Message)
	return ok && m.keyField != nil && protokey.KeyFromField(msg, m.keyField) != ""
}

// UseKey is a call option that sends key as the call's idempotency key, for
// example one saved with the business record so that a restarted process
// retries the same operation. It is sent on every attempt of the call, with
// or without UnaryClientInterceptor: it is made of gRPC per-call credentials,
// which gRPC sends over any connection. The interceptor checks the key before
// the call goes out and sends it as metadata instead. Without the
// interceptor, a call that also has per-call credentials of its own
// (grpc.PerRPCCredentials as a call option) sends only the last of the two
// given: use ContextWithKey there.
func UseKey(key string) grpc.CallOption {
	return grpc.PerRPCCredentials(keyCredentials{key: key})
}

// keyCredentials are the per-call credentials of UseKey: the key metadata.
type keyCredentials struct{ key string }

func (c keyCredentials) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{idemkey.KeyMetadata: idemkey.FormatKey(c.key)}, nil
}

func (keyCredentials) RequireTransportSecurity() bool { return false }

// useKey returns the key of the last UseKey among callOpts, and callOpts
// without the UseKey options.
func useKey(callOpts []grpc.CallOption) (key string, rest []grpc.CallOption, ok bool) {
	for _, o := range callOpts {
		if creds, isCreds := o.(grpc.PerRPCCredsCallOption); isCreds {
			if c, isKey := creds.Creds.(keyCredentials); isKey {
				key, ok = c.key, true
				continue
			}
		}
		rest = append(rest, o)
	}
	return key, rest, ok
}

type contextKeyMarker struct{}

// ContextWithKey returns a context whose calls carry key as their
// idempotency key. It puts the key in the outgoing metadata, so that it
// reaches the server with or without UnaryClientInterceptor; the interceptor
// sends it only to covered methods. Every call made with the context carries
// it, so use one context per operation.
func ContextWithKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(context.WithValue(ctx, contextKeyMarker{}, true), idemkey.KeyMetadata, idemkey.FormatKey(key))
}

// withoutKey is ctx with no idempotency key in its outgoing metadata.
func withoutKey(ctx context.Context) context.Context {
	md, ok := metadata.FromOutgoingContext(ctx)
	if !ok || len(md[idemkey.KeyMetadata]) == 0 {
		return ctx
	}
	delete(md, idemkey.KeyMetadata) // md is a copy
	return metadata.NewOutgoingContext(ctx, md)
}
