// Package idemkey is the vocabulary every idemkey entry point shares, and
// the map of them all.
//
// idemkey gives Go services Stripe-style idempotency keys. A client attaches
// one random key to one business operation and retries it as often as the
// network demands; the server runs the operation at most once and answers
// every retry with the first reply. A message consumer does the same with a
// message's id, so that a redelivery is dropped.
//
// # Entry points
//
//	gRPC, server and client    package interceptor  UnaryServerInterceptor(eng, ...Option), UnaryClientInterceptor(...MethodOption)
//	Connect, server and client package idemconnect  NewServerInterceptor(eng, ...Option), NewClientInterceptor(...ProcedureOption)
//	net/http (IETF draft)      package idemhttp     Middleware(eng, ...Option)
//	message consumers          package consumer     New(eng, name, ...Option), with idemnats (JetStream), idemamqp (RabbitMQ) or idemkafka (Kafka)
//	grpc-gateway               package idemgateway  ServeMuxOptions(...Option), in front of the gRPC interceptor
//
// A constructor whose configuration can be wrong returns the mistake as an
// error; none panics. eng is the one *engine.Engine that engine.New builds
// from a store and every setting the entry points share; hand the same one
// to each, so that a key means one operation over all of them. The records
// live in a store: store/memory, store/postgres (two-phase or atomic),
// store/redis.
//
// # Vocabulary
//
// This package holds what every entry point means by a key and an answer:
// the rules for a key (ValidateKey, MaxKeyLen; ParseKey, the one reading of a
// key's header or metadata value on every entry point, and FormatKey, an
// HTTP or Connect client's value for a key: an RFC 8941 string), the names
// on the wire (KeyMetadata, KeyHeader, ReplayedMetadata, ReplayedHeader),
// the reasons idemkey gives when it answers instead of the handler (the
// Reason constants, with the gRPC code and HTTP status beside each;
// ErrorDomain), and the keys a program makes: NewKey for a new operation,
// DeriveKey and DerivedKey for the calls an operation makes to other
// idempotent APIs.
//
// The repository's docs/answers.md has the table of every situation's
// answer on every entry point: gRPC code, HTTP status, consumer action.
//
// A client reads the reason back with Reason, from a gRPC or a Connect
// error alike (RetryDelay, the wait an in-progress answer asks), and with
// idemhttp.ProblemReason from an HTTP problem's type.
//
// # Keys
//
// A key is 1 to 255 bytes of visible ASCII (0x21 to 0x7E); NewKey makes a
// version 4 UUID. Errors and logs about a key never quote it.
package idemkey
