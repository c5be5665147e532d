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
// call carried one fails its test, since it checked nothing.
//
// # Effects counted
//
// Chaos.Effects is a function of yours that counts the operation's effects:
// a SELECT count(*) of the rows it writes, the calls a fake payment provider
// got. The Kit reads it before and after each call, and fails the test
// unless a call answered with success left exactly one effect and a call
// answered with an error left none: a side effect before an error stands
// while every retry is told the operation failed (a recorded error), or is
// made again by the retry (a released one). The count must see only the
// test's own calls: a Kit checks one call at a time.
//
//	countCharges := func(ctx context.Context) (int, error) {
//		var n int
//		err := pool.QueryRow(ctx, `SELECT count(*) FROM charges`).Scan(&n)
//		return n, err
//	}
//
// # Redelivery chaos for consumers
//
// Process delivers a batch of messages to a consumer.Consumer as a broker
// may: every message twice, out of order, and once more after its handler's
// effect but before its acknowledgement. It works at the consumer core, where
// idemnats and idemamqp hand each delivery over, so it serves every broker;
// h is the handler your adapter runs:
//
//	results := kit.Process(ctx, core, deliveries, func(ctx context.Context, d consumer.Delivery) error {
//		return charge(ctx, d.Tenant, d.Body)
//	})
//
// # Misuse caught, named
//
// A client whose key changes between attempts is caught by LoseReply: the
// caller's retry must carry the lost call's key, and the failure says to
// make the key once per operation (idemkey.NewKey before the retry loop,
// sent with interceptor.UseKey or idemkey.ContextWithKey). A handler that
// in atomic mode writes outside the call's transaction is caught by
// CheckAtomic, which runs the handler in an atomic call on your
// store/postgres store, rolls the call's transaction back, and counts the
// effects that stayed; the failure names postgres.TxFromContext:
//
//	kit.CheckAtomic(st, func(ctx context.Context) error {
//		_, err := svc.CreateCharge(ctx, req)
//		return err
//	})
//
// # Caveats
//
// A Kit's waits are bounded but real: an attempt told that its key is in
// progress is sent again after the server's retry delay, up to 40 times. A
// first attempt is cancelled "in its handler" once Effects counts its
// effect or a probe (an attempt with a deadline of 100ms, longer on a busy
// machine) hears that its key is in progress; a fast handler may end
// first, and over HTTP, where a deadline does not reach the server, a probe
// hears it only after the server's in-progress wait
// (engine.WithInProgressWait), so the report says whether the attempt was
// cancelled. The retry after a lost reply is
// the caller's next call through the Kit, whichever it is. Reports quote
// replies and codes, never a key.
package idemtest
