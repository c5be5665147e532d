// Package idemkey gives Go services Stripe-style idempotency keys, and is
// the vocabulary its entry points share. A client attaches one random key to
// one operation and retries it as often as it must; the server runs the
// operation at most once and answers every retry with the first reply. A
// message consumer does the same with a message's id.
//
// # Entry points
//
//	gRPC          package interceptor  UnaryServerInterceptor(eng, ...Option), UnaryClientInterceptor(...MethodOption)
//	Connect       package idemconnect  NewServerInterceptor(eng, ...Option), NewClientInterceptor(...ProcedureOption)
//	net/http      package idemhttp     Middleware(eng, ...Option)
//	consumers     package consumer     New(eng, name, ...Option), with idemnats, idemamqp or idemkafka
//	grpc-gateway  package idemgateway  ServeMuxOptions(...Option), in front of the gRPC interceptor
//
// eng is the one *engine.Engine that engine.New builds from a store
// (store/memory, store/postgres, store/redis); hand the same one to each
// entry point, so that a key means one operation over all of them. A
// constructor whose configuration can be wrong returns an error; none panics.
//
// # Vocabulary
//
// A key is 1 to 255 bytes of visible ASCII (ValidateKey); ParseKey reads a
// key's header or metadata value the same way on every entry point, and
// FormatKey writes one. NewKey makes a key for a new operation; DeriveKey
// and DerivedKey make the keys of the calls it makes to other idempotent
// APIs. Reason and RetryDelay read idemkey's answer back from a gRPC or
// Connect error (idemhttp.ProblemReason from an HTTP problem). Errors and
// logs about a key never quote it. docs/answers.md has every situation's
// answer on every entry point: gRPC code, HTTP status, consumer action.
package idemkey
