// Package idemtest is a kit for a user's own tests, as net/http/httptest
// is: it proves that the handlers and clients you write keep idemkey's
// promise, one effect per key, under the retries, duplicates, cancellations
// and redeliveries that production brings. idemkey runs a handler once per
// key, but the mistakes that break the promise are the handler's and the
// client's: a write through the pool in atomic mode, a side effect before an
// error, a key made inside the retry loop, a reply that a retry cannot see
// again. It depends on package testing and on what the core module already
// requires; the Connect adapter is idemconnect/idemconnecttest.
//
// # Retry chaos for clients
//
// A Kit applies its Chaos to each call that carries an idempotency key: it
// drops the first reply and sends the call again with the same key
// (DropReply), sends duplicates at once (Duplicates), cancels the first
// attempt in its handler and sends it again (Cancel), or answers the caller
// as a lost reply does so that the caller's own retry follows (LoseReply).
// Then it checks what every attempt got: the same answer, and for a
// success, one attempt that ran and every other marked replayed. A failure
// names the mistake and its fix, and lists each attempt:
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
//	// Connect: idemconnecttest.Interceptor(kit), after idemconnect.NewClientInterceptor().
//
// A call without a key passes through untouched; a Kit through which no
// call carried one fails its test, since it checked nothing. An answer that
// idemkey gave in the handler's place fails it too, named with its cause:
// a key reused for another request (the client sends one key for two
// operations), expired, a first-sent time refused, a key the server never
// saw, a store unavailable or full.
//
// # The server half
//
// Chained after idemkey's interceptor on the server under test, the Kit's
// server half sees each run of the handler for the key under check, and
// holds the first attempt that Cancel cancels once its handler has
// returned, until the Kit has cancelled it: the cancellation lands inside
// the call every time, however fast the handler. In atomic mode the held
// call's transaction then rolls back, as when a server dies before its
// commit, so that a write through the pool rather than
// postgres.TxFromContext leaves an effect that the retry makes again, and
// the Kit fails the test naming it:
//
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idem, kit.UnaryServerInterceptor()))
//
// # Effects counted
//
// Chaos.Effects is a function of yours that counts the operation's effects:
// a SELECT count(*) of the rows it writes, the calls a fake payment provider
// got. The Kit reads it before and after each call, and fails the test
// unless a call answered with success left exactly one effect and a call
// answered with an error left none: a side effect before an error stands
// while every retry is told the operation failed (a recorded error), or is
// made again by the retry (a released one). An effect counted only after
// the call's answer (a handler that makes it in a goroutine) is named as
// that: the Kit reads Effects again a few times, and before the next call.
// The count must see only the test's own calls: a Kit checks one call at a
// time.
//
//	countCharges := func(ctx context.Context) (int, error) {
//		var n int
//		err := pool.QueryRow(ctx, `SELECT count(*) FROM charges`).Scan(&n)
//		return n, err
//	}
//
// # Redelivery chaos for consumers
//
// Process delivers a batch of messages to a consumer (consumer.New on your
// engine, with your consumer's options) as a broker may: every message
// twice, out of order, and once more after its handler's effect but before
// its acknowledgement; in atomic mode, first to a consumer that dies before
// its commit, so that a write through the pool stands beside the next
// delivery's and fails the test. The kit is the consumer's broker, its
// messages consumer.Deliveries, so it serves every broker; h is what your
// handler does with a message's tenant and body:
//
//	results := kit.Process(ctx, eng, "charges", deliveries, func(ctx context.Context, d consumer.Delivery) error {
//		return charge(ctx, d.Tenant, d.Body)
//	}, consumer.WithAtomic())
//
// # Misuse caught, named
//
// LoseReply catches a client whose key changes between attempts; the server
// half under Cancel, and CheckAtomic (a handler run in an atomic call whose
// transaction then rolls back), catch a handler that in atomic mode writes
// outside postgres.TxFromContext's transaction. The repository's
// docs/testkit.md has an example of each.
//
// # Caveats
//
// A Kit's waits are bounded but real: an attempt told that its key is in
// progress is sent again after the server's retry delay, up to 40 times. A
// call answered with success whose effect is not counted is counted again
// for up to about two seconds. Without the server half (over HTTP and
// Connect, which have none), a first attempt is cancelled "in its handler"
// once Effects counts its effect or a probe (an attempt with a deadline of
// 100ms, longer on a busy machine) hears that its key is in progress; a
// fast handler may end first, and over HTTP, where a deadline does not
// reach the server, a probe hears it only after the server's in-progress
// wait (engine.WithInProgressWait), so the report says whether the attempt
// was cancelled; CheckAtomic then is the check of atomic mode. With the
// server half, a handler that waits for its cancellation before it makes
// any effect is cancelled only after 30 s. An error answer that a later attempt ran past
// (not replayed) was released, not recorded: the later answer is the
// call's. The retry after a lost reply is the caller's next call through
// the Kit, whichever it is. Reports quote replies, codes and idemkey's
// reasons, never a key.
package idemtest
