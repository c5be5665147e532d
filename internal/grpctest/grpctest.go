// Package grpctest runs a real grpc-go server and client over an in-memory
// connection (bufconn), for tests that need no port.
package grpctest

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/store"
)

// Serve starts srv on an in-memory listener and stops it when tb ends.
func Serve(tb testing.TB, srv *grpc.Server) *bufconn.Listener {
	lis := bufconn.Listen(1 << 20)
	go func() { _ = srv.Serve(lis) }()
	tb.Cleanup(srv.Stop)
	return lis
}

// Dial connects a client to lis with opts added, and closes the connection
// when tb ends, before the server stops.
func Dial(tb testing.TB, lis *bufconn.Listener, opts ...grpc.DialOption) *grpc.ClientConn {
	tb.Helper()
	conn, err := grpc.NewClient("passthrough:///bufnet", append([]grpc.DialOption{
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
	}, opts...)...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { conn.Close() })
	return conn
}

// Must returns v, and panics if err is not nil: for a test's own setup, such
// as an interceptor built from options the test knows to be right.
func Must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// Interceptor is the server interceptor on an engine of st, given the
// engine options and the interceptor options among opts; it panics on a
// mistake. Its engine serves one tenant unless opts give engine.WithTenant.
func Interceptor(st store.Store, opts ...any) grpc.UnaryServerInterceptor {
	var eopts []engine.Option
	var iopts []interceptor.Option
	for _, o := range opts {
		switch o := o.(type) {
		case engine.Option:
			eopts = append(eopts, o)
		case interceptor.Option:
			iopts = append(iopts, o)
		default:
			panic(fmt.Sprintf("grpctest.Interceptor: %T is no option", o))
		}
	}
	ic, err := interceptor.UnaryServerInterceptor(Must(engine.New(st, eopts...)), iopts...)
	if err != nil && strings.Contains(err.Error(), "engine.WithSingleTenant") {
		// No engine.WithTenant among opts: the tests' single tenant.
		ic, err = interceptor.UnaryServerInterceptor(Must(engine.New(st, append(eopts, engine.WithSingleTenant())...)), iopts...)
	}
	return Must(ic, err)
}
