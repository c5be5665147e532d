package engine_test

// The examples import no entry point: this package's tests, and so the
// go.sum of every module that imports the engine, need no protobuf. The
// entry points' own examples run a call through an engine: interceptor,
// idemhttp, idemconnect, idemgateway.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store/memory"
)

// callerKey is where the application's authentication puts the caller.
type callerKey struct{}

// tenantOf is the engine's TenantFunc: the caller that the authentication
// layer verified and put in the call's context.
func tenantOf(ctx context.Context) (string, error) {
	caller, ok := ctx.Value(callerKey{}).(string)
	if !ok {
		return "", errors.New("not signed in")
	}
	return caller, nil
}

// One engine on a store, with the settings every entry point shares: hand
// it to each entry point that serves the store's keys
// (interceptor.UnaryServerInterceptor(eng), idemconnect.NewServerInterceptor(eng),
// idemhttp.Middleware(eng), consumers), so that they share its keys, its
// bounds and its metrics.
func ExampleNew() {
	eng, err := engine.New(memory.New(),
		engine.WithTenant(tenantOf), // each caller's keys are its own
		engine.WithKeyRequired(),
		engine.WithRetention(48*time.Hour),
		engine.WithMaxRecordSize(64<<10), // the replies are small: the memory store runs more calls at once
	)
	if err != nil {
		panic(err)
	}
	fmt.Println("retention:", eng.Retention(), "record size:", eng.MaxRecordSize())
	// Output:
	// retention: 48h0m0s record size: 65536
}

// New checks the options once, and its error names the fix.
func ExampleNew_mistake() {
	_, err := engine.New(memory.New(), engine.WithTenant(tenantOf), engine.WithRetention(time.Minute))
	fmt.Println(err)
	// Output:
	// idemkey: the retention (1m0s, WithRetention) is shorter than the longest lease (10m0s, WithMaxLease): a record would expire while its call may still run; lengthen the retention or shorten the maximum lease
}

// An entry point asks the engine for each kind of call it serves; the
// engine refuses what its store cannot serve, such as atomic mode on a
// store without transactions, once, at start-up.
func ExampleEngine_Operation() {
	eng, err := engine.New(memory.New(), engine.WithTenant(tenantOf))
	if err != nil {
		panic(err)
	}
	op, err := eng.Operation(engine.OperationSpec{Name: "/example.payments.v1.PaymentService/CreateCharge"})
	fmt.Println(op.Name(), op.Atomic(), err)
	_, err = eng.Operation(engine.OperationSpec{Name: "/example.payments.v1.PaymentService/CreateCharge", Atomic: true})
	fmt.Println(err)
	// Output:
	// /example.payments.v1.PaymentService/CreateCharge false <nil>
	// idemkey: atomic mode needs a store that implements store.Atomic, such as store/postgres; *memory.Store does not
}
