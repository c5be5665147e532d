package example_test

import (
	"bufio"
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/postgres"
)

// snippet is a region of compiled Go that README.md or a page of docs/
// shows: the lines between "// readme:NAME" and "// end readme" in a .go file
// of this directory.
type snippet struct {
	name, file string
	line       int // of the marker
	text       string
}

// TestREADMESnippets keeps the Go of README.md and docs/*.md in step with the
// compiled code: every marked region must appear in one of them as a ```go
// block, verbatim, and every ```go block of them must be one of the regions.
func TestREADMESnippets(t *testing.T) {
	snippets := readSnippets(t)
	if len(snippets) == 0 {
		t.Fatal("no // readme:NAME regions found in example/*.go")
	}
	pages, err := filepath.Glob(filepath.Join("..", "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	var blocks []block
	for _, page := range append([]string{filepath.Join("..", "README.md")}, pages...) {
		blocks = append(blocks, readGoBlocks(t, page)...)
	}
	used := make(map[int]bool)
	for _, s := range snippets {
		found := false
		for i, b := range blocks {
			if b.text == s.text {
				found, used[i] = true, true
			}
		}
		if !found {
			t.Errorf("snippet %q (%s:%d) is in neither README.md nor docs/*.md as a ```go block; %s",
				s.name, s.file, s.line, closest(s.text, blocks))
		}
	}
	for i, b := range blocks {
		if !used[i] {
			t.Errorf("%s:%d: this ```go block comes from no compiled snippet: put it in a .go file of example/ between // readme:NAME and // end readme, so that it compiles", b.file, b.line)
		}
	}
}

// readSnippets returns the marked regions of the .go files in this directory,
// without the indentation they share.
func readSnippets(t *testing.T) []snippet {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var out []snippet
	names := make(map[string]string)
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		var cur *snippet
		var lines []string
		for i, line := range strings.Split(string(data), "\n") {
			trimmed := strings.TrimSpace(line)
			switch {
			case strings.HasPrefix(trimmed, "// readme:"):
				if cur != nil {
					t.Fatalf("%s:%d: readme region inside %q, which is not ended", file, i+1, cur.name)
				}
				name := strings.TrimPrefix(trimmed, "// readme:")
				if prev, ok := names[name]; ok {
					t.Fatalf("%s:%d: readme region %q already in %s", file, i+1, name, prev)
				}
				names[name] = file
				cur, lines = &snippet{name: name, file: file, line: i + 1}, nil
			case trimmed == "// end readme":
				if cur == nil {
					t.Fatalf("%s:%d: // end readme without a region", file, i+1)
				}
				cur.text = dedent(lines)
				out = append(out, *cur)
				cur = nil
			case cur != nil:
				lines = append(lines, line)
			}
		}
		if cur != nil {
			t.Fatalf("%s:%d: readme region %q has no // end readme", file, cur.line, cur.name)
		}
	}
	return out
}

// dedent removes the leading tabs that all non-blank lines share, and blank
// lines at either end.
func dedent(lines []string) string {
	for len(lines) > 0 && strings.TrimSpace(lines[0]) == "" {
		lines = lines[1:]
	}
	for len(lines) > 0 && strings.TrimSpace(lines[len(lines)-1]) == "" {
		lines = lines[:len(lines)-1]
	}
	common := -1
	for _, l := range lines {
		if strings.TrimSpace(l) == "" {
			continue
		}
		n := len(l) - len(strings.TrimLeft(l, "\t"))
		if common < 0 || n < common {
			common = n
		}
	}
	out := make([]string, len(lines))
	for i, l := range lines {
		if strings.TrimSpace(l) == "" {
			continue
		}
		out[i] = l[max(common, 0):]
	}
	return strings.Join(out, "\n")
}

type block struct {
	file string // from the repository root
	line int    // of the opening fence
	text string
}

// readGoBlocks returns the ```go blocks of a Markdown file, path being
// from this directory.
func readGoBlocks(t *testing.T, path string) []block {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var blocks []block
	var cur *block
	var lines []string
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case cur == nil && strings.TrimSpace(line) == "```go":
			cur, lines = &block{file: filepath.ToSlash(strings.TrimPrefix(path, ".."+string(filepath.Separator))), line: n}, nil
		case cur != nil && strings.TrimSpace(line) == "```":
			cur.text = dedent(lines)
			blocks = append(blocks, *cur)
			cur = nil
		case cur != nil:
			lines = append(lines, line)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if cur != nil {
		t.Fatalf("%s:%d: ```go block not closed", path, cur.line)
	}
	return blocks
}

// closest names the block that shares the longest prefix with text,
// and the first line where they differ.
func closest(text string, blocks []block) string {
	want := strings.Split(text, "\n")
	best, bestLen := -1, -1
	for i, b := range blocks {
		got := strings.Split(b.text, "\n")
		n := 0
		for n < len(want) && n < len(got) && want[n] == got[n] {
			n++
		}
		if n > bestLen {
			best, bestLen = i, n
		}
	}
	if best < 0 || bestLen == 0 {
		return "no block starts like it"
	}
	got := strings.Split(blocks[best].text, "\n")
	gotLine := "(the block ends)"
	if bestLen < len(got) {
		gotLine = got[bestLen]
	}
	wantLine := "(the snippet ends)"
	if bestLen < len(want) {
		wantLine = want[bestLen]
	}
	return "the block at " + blocks[best].file + ":" + strconv.Itoa(blocks[best].line) + " differs at its line " + strconv.Itoa(bestLen+1) +
		":\n\tblock:   " + gotLine + "\n\tsnippet: " + wantLine
}

var readmeCharge = &paymentsv1.CreateChargeRequest{CustomerId: "cus_readme", Amount: 1999, Currency: "EUR"}

// listen serves on a loopback port until the test ends.
func listen(t *testing.T) net.Listener {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lis.Close() })
	return lis
}

// The README's server and client charge once.
func TestREADMEUse(t *testing.T) {
	lis := listen(t)
	srv := grpctest.Must(newServer())
	go srv.Serve(lis)
	defer srv.Stop()

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	c, err := charge(ctx, lis.Addr().String(), readmeCharge)
	if err != nil {
		t.Fatalf("CreateCharge: %v", err)
	}
	if c.GetId() == "" || c.GetAmount() != readmeCharge.GetAmount() {
		t.Errorf("CreateCharge = %v, want a charge of %d", c, readmeCharge.GetAmount())
	}
}

// The README's PostgreSQL server migrates its table and records the key.
func TestREADMEPostgres(t *testing.T) {
	schema := pgtest.Schema(t)
	lis := listen(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- servePostgres(ctx, lis, pgtest.SchemaURL(schema)) }()

	if _, err := charge(ctx, lis.Addr().String(), readmeCharge); err != nil {
		t.Fatalf("CreateCharge: %v", err)
	}
	var n int
	if err := pgtest.Pool(t, schema).QueryRow(ctx, `SELECT count(*) FROM `+postgres.DefaultTable).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Errorf("%d idempotency records, want 1", n)
	}
	cancel()
	if err := <-served; err != nil {
		t.Errorf("servePostgres: %v", err)
	}
}

// paymentsStore is a store on a fresh schema with the atomic snippet's
// payments table, and its pool.
func paymentsStore(t *testing.T) (*postgres.Store, *pgxpool.Pool) {
	t.Helper()
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if _, err := pool.Exec(t.Context(), `CREATE TABLE payments (id text PRIMARY KEY, amount bigint, currency text)`); err != nil {
		t.Fatal(err)
	}
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	return st, pool
}

// The README's atomic handler writes its charge in the call's transaction.
func TestREADMEAtomic(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	st, pool := paymentsStore(t)
	lis := listen(t)
	srv := grpctest.Must(newAtomicServer(st))
	go srv.Serve(lis)
	defer srv.Stop()

	c, err := charge(ctx, lis.Addr().String(), readmeCharge)
	if err != nil {
		t.Fatalf("CreateCharge: %v", err)
	}
	var amount int64
	if err := pool.QueryRow(ctx, `SELECT amount FROM payments WHERE id = $1`, c.GetId()).Scan(&amount); err != nil {
		t.Fatalf("the charge's row: %v", err)
	}
	if amount != readmeCharge.GetAmount() {
		t.Errorf("amount %d, want %d", amount, readmeCharge.GetAmount())
	}
}

// The README's atomic guard, on a server deployed without
// WithAtomicMethods, answers a code that releases the key: once the server
// is fixed, the same key charges, rather than replay the guard's error for
// the key's whole retention.
func TestREADMEAtomicGuardReleases(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	st, pool := paymentsStore(t)
	serve := func(srv *grpc.Server) paymentsv1.PaymentServiceClient {
		lis := listen(t)
		go srv.Serve(lis)
		t.Cleanup(srv.Stop)
		conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return paymentsv1.NewPaymentServiceClient(conn)
	}
	call := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer acme", idemkey.KeyMetadata, idemkey.NewKey())

	// The deploy that forgot WithAtomicMethods: two-phase, on the same store.
	eng := grpctest.Must(engine.New(st, engine.WithTenant(callerTenant), engine.WithKeyRequired()))
	broken := grpc.NewServer(grpc.ChainUnaryInterceptor(authInterceptor, grpctest.Must(interceptor.UnaryServerInterceptor(eng))))
	paymentsv1.RegisterPaymentServiceServer(broken, &ledger{})
	if _, err := serve(broken).CreateCharge(call, readmeCharge); status.Code(err) != codes.Unavailable {
		t.Fatalf("the guard answered %v, want Unavailable", err)
	}

	fixed := grpctest.Must(newAtomicServer(st))
	c, err := serve(fixed).CreateCharge(call, readmeCharge)
	if err != nil {
		t.Fatalf("the same key on the fixed server: %v, want a charge", err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM payments WHERE id = $1`, c.GetId()).Scan(&n); err != nil || n != 1 {
		t.Fatalf("the charge's row: %d, %v", n, err)
	}
}
