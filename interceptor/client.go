package interceptor

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
)

// UnaryClientInterceptor returns a client interceptor that attaches an
// idempotency key to every call of a covered method that carries none: the
// caller's own (UseKey, ContextWithKey) or else a fresh idemkey.NewKey.
//
// gRPC runs the retries of its service-config retry policy below all
// interceptors, so every attempt of one call carries the same key. A retry
// loop of your own must run inside this interceptor (a retry interceptor
// chained after it), or reuse one key through UseKey or ContextWithKey;
// otherwise each attempt gets a key of its own.
func UnaryClientInterceptor(opts ...Option) grpc.UnaryClientInterceptor {
	o := newOptions(opts)
	ms := &methods{opts: o}
	return func(ctx context.Context, fullMethod string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		if !ms.get(fullMethod).covered {
			return invoker(ctx, fullMethod, req, reply, cc, callOpts...)
		}
		if md, _ := metadata.FromOutgoingContext(ctx); len(md[idemkey.KeyMetadata]) > 0 {
			return invoker(ctx, fullMethod, req, reply, cc, callOpts...)
		}
		key, ok := keyFrom(ctx, callOpts)
		if !ok {
			key = idemkey.NewKey()
		} else if err := idemkey.ValidateKey(key); err != nil {
			return err
		}
		ctx = metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, key)
		return invoker(ctx, fullMethod, req, reply, cc, callOpts...)
	}
}

// UseKey is a call option that sends key as the call's idempotency key, for
// example one saved with the business record so that a restarted process
// retries the same operation.
func UseKey(key string) grpc.CallOption {
	return keyCallOption{key: key}
}

type keyCallOption struct {
	grpc.EmptyCallOption
	key string
}

type keyContextKey struct{}

// ContextWithKey returns a context whose calls to covered methods carry key as
// their idempotency key. Every such call made with the context carries it, so
// use one context per operation.
func ContextWithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyContextKey{}, key)
}

// keyFrom returns the caller's key: a UseKey call option wins over the context.
func keyFrom(ctx context.Context, callOpts []grpc.CallOption) (string, bool) {
	for i := len(callOpts) - 1; i >= 0; i-- {
		if o, ok := callOpts[i].(keyCallOption); ok {
			return o.key, true
		}
	}
	key, ok := ctx.Value(keyContextKey{}).(string)
	return key, ok
}
