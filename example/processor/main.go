// Command processor runs the example card processor (example.Processor), a
// downstream service that does not honour idempotency keys: every POST
// /charges charges. The example server's tests run it as a process of its
// own, so that its charges are counted across the server's restarts.
//
//	go run ./example/processor [-addr 127.0.0.1:8090] [-addr-file PATH] [-answer-delay 0s] [-hang]
//
// With -addr 127.0.0.1:0 it listens on a free port; -addr-file names a file
// where it writes the address it listens on once it serves, removed on exit.
// -answer-delay is how long it waits after a charge before it answers, so
// that a caller's crash can fall inside the call. With -hang it charges and
// then never answers a POST: it holds the request
// until the client gives up, as a processor whose answer is lost. SIGINT or
// SIGTERM stops it.
package main

import (
	"context"
	"errors"
	"flag"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/idemkey/idemkey/example"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8090", "address to listen on; port 0 picks a free port")
	addrFile := flag.String("addr-file", "", "if set, write the address listened on to this file once serving, and remove it on exit")
	delay := flag.Duration("answer-delay", 0, "how long to wait after a charge before answering it")
	hang := flag.Bool("hang", false, "charge, then never answer a POST: hold it until the client gives up")
	flag.Parse()

	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *addr, *addrFile, example.NewProcessor(*delay, *hang), logger); err != nil {
		logger.Error("processor stopped", "error", err)
		os.Exit(1)
	}
}

// run serves p on addr until ctx is done.
func run(ctx context.Context, addr, addrFile string, p *example.Processor, logger *slog.Logger) error {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	logger.Info("processor listening", "addr", lis.Addr().String())
	if addrFile != "" {
		defer os.Remove(addrFile)
		tmp := addrFile + ".tmp"
		if err := os.WriteFile(tmp, []byte(lis.Addr().String()+"\n"), 0o644); err != nil {
			srv.Close()
			return err
		}
		if err := os.Rename(tmp, addrFile); err != nil {
			srv.Close()
			return err
		}
	}
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	// A hanging processor's requests never end: close them.
	srv.Close()
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
