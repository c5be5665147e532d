// Command server runs the example payment service behind the idemkey
// interceptor.
//
//	go run ./example/server [-addr 127.0.0.1:50051] [-database-url URL] [-handler-delay 0s] [-ttl 24h]
//
// Callers authenticate with "authorization: Bearer sk_test_acme" (tenant acme)
// or "Bearer sk_test_globex" (tenant globex). CreateCharge requires an
// idempotency key. SIGINT or SIGTERM stops the server gracefully.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/store/memory"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:50051", "address to listen on")
	databaseURL := flag.String("database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL for the idempotency store (not available yet: leave it empty for the in-memory store)")
	delay := flag.Duration("handler-delay", 0, "how long CreateCharge waits after writing a charge")
	ttl := flag.Duration("ttl", interceptor.DefaultRetention, "how long a recorded reply is replayed")
	flag.Parse()

	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := run(*addr, *databaseURL, *delay, *ttl, logger); err != nil {
		logger.Error("server stopped", "error", err)
		os.Exit(1)
	}
}

func run(addr, databaseURL string, delay, ttl time.Duration, logger *slog.Logger) error {
	if databaseURL != "" {
		return errors.New("-database-url: the PostgreSQL store is not available yet; leave it (and DATABASE_URL) empty for the in-memory store")
	}
	srv, hs := example.NewServer(memory.New(), example.Config{
		HandlerDelay: delay,
		Options:      []interceptor.Option{interceptor.WithRetention(ttl), interceptor.WithLogger(logger)},
	})
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	logger.Info("payment service listening", "addr", lis.Addr().String(), "store", "memory", "handler_delay", delay)

	select {
	case err := <-served:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	logger.Info("shutting down")
	hs.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	stopped := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		srv.Stop()
	}
	return nil
}
