package spanner_test

import (
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemkey/idemkey/internal/adaptertest"
	"github.com/idemkey/idemkey/internal/adaptertest/httpadapter"
	"github.com/idemkey/idemkey/store"
	idemspanner "github.com/idemkey/idemkey/store/spanner"
	"github.com/idemkey/idemkey/tests/spannertest"
)

// TestAdapterCases runs the behaviour cases every entry point passes, over
// net/http (the cases are the engine's, the same on every transport), on
// Spanner in both modes, each case on a database of its own.
func TestAdapterCases(t *testing.T) {
	adaptertest.Run(t, httpadapter.Adapter(), adaptertest.Store{
		Name: "spanner",
		New: func(t *testing.T) store.Store {
			st, _ := newStore(t)
			return st
		},
		Down:   downStore,
		Atomic: true,
	})
}

// downStore is a store whose server does not answer: nothing listens on
// port 1.
func downStore(t *testing.T) store.Store {
	spannertest.Database(t) // skips, or fails in CI, without the emulator, as the other cases do
	client, err := spanner.NewClientWithConfig(t.Context(), "projects/p/instances/i/databases/d",
		spanner.ClientConfig{DisableNativeMetrics: true},
		option.WithEndpoint("127.0.0.1:1"), option.WithoutAuthentication(),
		option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials())))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(client.Close)
	st, err := idemspanner.New(client, idemspanner.WithTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return st
}
