// Package idemtest is a kit for a user's own tests, as net/http/httptest
// is: it proves that the handlers and clients you write keep idemkey's
// promise, one effect per key, under the retries, duplicates, cancellations
// and redeliveries that production brings. The mistakes that break the
// promise are the handler's and the client's: a write through the pool in
// atomic mode, a side effect before an error, a key made inside the retry
// loop. The Connect adapter is idemconnect/idemconnecttest.
//
// # Retry chaos for clients
//
// A Kit applies its Chaos to each call that carries an idempotency key: it
// drops the first reply and sends the call again with the same key
// (DropReply), sends duplicates at once (Duplicates), cancels the first
// attempt in its handler (Cancel), or answers as a lost reply does so that
// the caller's own retry follows (LoseReply). Then it checks that every
// attempt got the same answer, one ran and the others were replayed, and
// that Chaos.Effects counted one effect for a success and none for an
// error. A failure names the mistake and its fix, and lists each attempt:
//
//	kit := idemtest.New(t, idemtest.Chaos{DropReply: true, Duplicates: 3, Cancel: true, Effects: countCharges})
//
//	// gRPC: after the key interceptor, where grpc-go's own retries run.
//	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
//		grpc.WithChainUnaryInterceptor(keys, kit.UnaryClientInterceptor()))
//
//	// HTTP (idemhttp's middleware, or anything that reads Idempotency-Key).
//	client := &http.Client{Transport: kit.RoundTripper(nil)}
//
// A Kit through which no call carried a key fails its test. An answer
// idemkey gave in the handler's place (a key reused, expired, a store
// unavailable) fails it too, named with its cause.
//
// # The server half
//
// Chained after idemkey's interceptor on the server under test, the Kit's
// server half holds the first attempt that Cancel cancels until the Kit has
// cancelled it, so the cancellation lands every time; in atomic mode the
// call's transaction then rolls back, so a write through the pool rather
// than postgres.TxFromContext fails the test. CheckAtomic does the same
// where the server half cannot go (HTTP, Connect).
//
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idem, kit.UnaryServerInterceptor()))
//
// # Redelivery chaos for consumers
//
// Process delivers messages to a consumer (consumer.New on your engine,
// with your consumer's options; the kit is its broker) as a broker may:
// every message twice, out of order, and again after its handler's effect
// but before its acknowledgement; in atomic mode, first to a consumer that
// dies before its commit.
//
// The repository's docs/testkit.md has examples, what Effects must count,
// and the caveats (the Kit's waits are bounded but real; reports never quote
// a key).
package idemtest
