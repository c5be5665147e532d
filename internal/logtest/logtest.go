// Package logtest collects what a slog.Logger writes, at every level, for
// tests that check log records: that a failure is logged, and that nothing
// raw (a key, a tenant, a request) is.
package logtest

import (
	"bytes"
	"log/slog"
	"sync"
)

// New returns a logger that writes text records of every level, Debug
// included, to the returned Buffer.
func New() (*slog.Logger, *Buffer) {
	buf := &Buffer{}
	return slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug})), buf
}

// Buffer is a bytes.Buffer safe for the writes of many goroutines.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
