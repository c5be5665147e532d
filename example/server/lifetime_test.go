package main

import (
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/tests/redistest"
)

// One key over gRPC, Connect and HTTP tells one expiry: the first reply and
// the replays over the other two carry the same Idempotency-Key-Expires, an
// hour (the server's -ttl) from the first call. A retry first sent more than
// that ago, over any of them, is refused (FailedPrecondition, 412) and
// charges nothing: the key then runs once, fresh. On memory, PostgreSQL in
// both modes and Redis.
func TestKeyLifetimeOnEveryEntryPoint(t *testing.T) {
	for name, open := range map[string]func(t *testing.T) (config, string){
		"memory": func(*testing.T) (config, string) { return config{}, "" },
		"postgres/atomic": func(t *testing.T) (config, string) {
			schema := pgtest.Schema(t)
			return config{databaseURL: pgtest.SchemaURL(schema), atomic: true}, schema
		},
		"postgres/2-phase": func(t *testing.T) (config, string) {
			schema := pgtest.Schema(t)
			return config{databaseURL: pgtest.SchemaURL(schema)}, schema
		},
		"redis": func(t *testing.T) (config, string) { return config{redisURL: "redis://" + redistest.Start(t).Addr}, "" },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cfg, schema := open(t)
			e := startEntryPoints(t, cfg)
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
			for i, order := range [][3]string{{"grpc", "connect", "http"}, {"http", "grpc", "connect"}, {"connect", "http", "grpc"}} {
				key := idemkey.NewKey()
				start := time.Now().Truncate(time.Second)
				var first string
				for j, via := range order {
					a := e.lifetime(t, via, key, "", req)
					if a.err != nil || a.replayed != (j > 0) {
						t.Fatalf("order %d, %s: %v (replayed %v)", i, via, a.err, a.replayed)
					}
					if j == 0 {
						first = a.expires
						exp, err := idemkey.ParseDate(first)
						if err != nil || exp.Before(start.Add(time.Hour)) || exp.After(time.Now().Add(time.Hour)) {
							t.Fatalf("order %d, %s: expiry %q, want an HTTP date an hour from the call", i, via, first)
						}
					} else if a.expires != first {
						t.Errorf("order %d, %s: expiry %q, want the first reply's %q", i, via, a.expires, first)
					}
				}
			}

			key := idemkey.NewKey()
			stale := idemkey.FormatDate(time.Now().Add(-time.Hour - time.Minute))
			for _, via := range []string{"grpc", "connect", "http"} {
				a := e.lifetime(t, via, key, stale, req)
				if a.reason != idemkey.ReasonKeyExpired || a.code != map[string]int{"grpc": int(codes.FailedPrecondition),
					"connect": int(connect.CodeFailedPrecondition), "http": http.StatusPreconditionFailed}[via] {
					t.Fatalf("%s, first sent an hour ago: %+v, want %s", via, a, idemkey.ReasonKeyExpired)
				}
			}
			a := e.lifetime(t, "grpc", key, idemkey.FormatDate(time.Now()), req)
			if a.err != nil || a.replayed {
				t.Fatalf("the key first sent now, after three refusals: %v (replayed %v), want a first run", a.err, a.replayed)
			}
			if schema != "" { // the charges are in PostgreSQL: one per key, three and the last
				var charges int
				if err := pgtest.Pool(t, schema).QueryRow(t.Context(), `SELECT count(*) FROM charges`).Scan(&charges); err != nil || charges != 4 {
					t.Errorf("%d charges (%v), want 4: one per key, none for a refused retry", charges, err)
				}
			}
		})
	}
}

// answer is what a client saw of one CreateCharge.
type answer struct {
	err      error
	replayed bool
	expires  string // the key's expiry told, or ""
	code     int    // the status of an error
	reason   string // the idemkey reason of an error
}

// lifetime sends CreateCharge via one entry point with key and, if not "",
// the first-sent time, and reads the expiry wherever that entry point puts
// it: gRPC's header or trailer, Connect's and HTTP's headers.
func (e *entryPoints) lifetime(t *testing.T, via, key, firstSent string, req *paymentsv1.CreateChargeRequest) answer {
	t.Helper()
	switch via {
	case "grpc":
		ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
		if firstSent != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, idemkey.FirstSentMetadata, firstSent)
		}
		var header, trailer metadata.MD
		_, err := e.grpc.CreateCharge(ctx, req, grpc.Header(&header), grpc.Trailer(&trailer))
		a := answer{err: err, replayed: idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), code: int(status.Code(err)), reason: idemkey.Reason(err)}
		a.expires = strings.Join(append(header.Get(idemkey.ExpiresMetadata), trailer.Get(idemkey.ExpiresMetadata)...), ",")
		return a
	case "connect":
		r := connect.NewRequest(req)
		r.Header().Set("Authorization", "Bearer sk_test_acme")
		r.Header().Set(idemkey.KeyHeader, key)
		if firstSent != "" {
			r.Header().Set(idemkey.FirstSentHeader, firstSent)
		}
		resp, err := e.connect.CreateCharge(t.Context(), r)
		var ce *connect.Error
		if errors.As(err, &ce) {
			return answer{err: err, code: int(ce.Code()), reason: idemkey.Reason(err), expires: ce.Meta().Get(idemkey.ExpiresHeader)}
		} else if err != nil {
			t.Fatal(err)
		}
		return answer{replayed: idemkey.ParseReplayed(resp.Header().Values(idemkey.ReplayedHeader)), expires: resp.Header().Get(idemkey.ExpiresHeader)}
	default:
		hreq, err := http.NewRequestWithContext(t.Context(), http.MethodPost, e.http+"/v1/charges", strings.NewReader(jsonOf(t, req)))
		if err != nil {
			t.Fatal(err)
		}
		hreq.Header.Set("Authorization", "Bearer sk_test_acme")
		hreq.Header.Set(idemkey.KeyHeader, key)
		if firstSent != "" {
			hreq.Header.Set(idemkey.FirstSentHeader, firstSent)
		}
		resp, err := http.DefaultClient.Do(hreq)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		a := answer{code: resp.StatusCode, replayed: resp.Header.Get(idemkey.ReplayedHeader) == "true", expires: resp.Header.Get(idemkey.ExpiresHeader)}
		if resp.StatusCode != http.StatusCreated {
			var problem idemhttp.Problem
			_ = json.NewDecoder(resp.Body).Decode(&problem)
			a.err, a.reason = errors.New(resp.Status), idemhttp.ProblemReason(problem.Type)
		}
		return a
	}
}

// While the first call of a key runs, a duplicate over each entry point is
// told the same expiry as the first reply and every replay after it: one
// instant for one key, on every store, in atomic mode too, where the record
// is not committed until the call ends (the store reads the running
// transaction's start). The first call runs longer than a duplicate waits
// (engine.DefaultInProgressWait), so each is answered in progress.
func TestInFlightExpiryOnEveryEntryPoint(t *testing.T) {
	for name, open := range map[string]func(t *testing.T) config{
		"memory": func(*testing.T) config { return config{} },
		"postgres/atomic": func(t *testing.T) config {
			return config{databaseURL: pgtest.SchemaURL(pgtest.Schema(t)), atomic: true}
		},
		"postgres/2-phase": func(t *testing.T) config { return config{databaseURL: pgtest.SchemaURL(pgtest.Schema(t))} },
		"redis":            func(t *testing.T) config { return config{redisURL: "redis://" + redistest.Start(t).Addr} },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cfg := open(t)
			cfg.delay = 4 * engine.DefaultInProgressWait // twice as long as the duplicates wait, for a busy machine
			metricsFile := filepath.Join(t.TempDir(), "metrics-addr")
			cfg.metricsAddr, cfg.metricsAddrFile = "127.0.0.1:0", metricsFile
			e := startEntryPoints(t, cfg)
			var addr []byte
			waitUntil(t, "the metrics address file is written", func() bool {
				addr, _ = os.ReadFile(metricsFile)
				return len(addr) > 0
			})
			metricsURL := "http://" + strings.TrimSpace(string(addr)) + "/metrics"
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
			key := idemkey.NewKey()
			first := make(chan answer, 1)
			go func() { first <- e.lifetime(t, "grpc", key, "", req) }()
			// The first call holds the key once its reservation has ended.
			waitUntil(t, "the first call holds its key", func() bool {
				text := scrape(t, metricsURL)
				return storeOps(t, text, "reserve")+storeOps(t, text, "begin") > 0
			})
			// The duplicates run at once, each waiting less than the first
			// call has left.
			vias := []string{"grpc", "connect", "http"}
			dups := make([]answer, len(vias))
			var wg sync.WaitGroup
			for i, via := range vias {
				wg.Go(func() { dups[i] = e.lifetime(t, via, key, "", req) })
			}
			wg.Wait()
			var told []string
			for i, a := range dups {
				if a.reason != idemkey.ReasonInProgress || a.expires == "" {
					t.Fatalf("%s while the first call runs: %+v, want in progress with an expiry", vias[i], a)
				}
				told = append(told, vias[i]+" "+a.expires)
			}
			a := <-first
			if a.err != nil || a.expires == "" {
				t.Fatalf("the first call: %+v", a)
			}
			for _, via := range []string{"grpc", "connect", "http"} {
				r := e.lifetime(t, via, key, "", req)
				if !r.replayed {
					t.Fatalf("%s after the first call: %+v, want a replay", via, r)
				}
				told = append(told, via+" replay "+r.expires)
			}
			for _, got := range told {
				if !strings.HasSuffix(got, " "+a.expires) {
					t.Errorf("told %q, and the first reply %q: want one instant", got, a.expires)
				}
			}
		})
	}
}

// With -ttl 2s -max-lease 1s the server shows a key expiring: a retry
// within the key's life replays its charge, and once the expiry it was told
// (idempotency-key-expires) has passed, the same key runs as a new call, a
// charge of its own, never before that instant. On memory, PostgreSQL
// (atomic), Redis, and Spanner and three PostgreSQL shards in both modes.
func TestShortTTLKeyExpires(t *testing.T) {
	for name, flags := range map[string]func(t *testing.T) []string{
		"memory":   func(*testing.T) []string { return []string{"-database-url="} },
		"postgres": func(t *testing.T) []string { return []string{"-database-url", pgtest.SchemaURL(pgtest.Schema(t))} },
		"redis": func(t *testing.T) []string {
			return []string{"-database-url=", "-redis-url", "redis://" + redistest.Start(t).Addr}
		},
		spannerAtomic.name:   spannerAtomic.args,
		spannerTwoPhase.name: spannerTwoPhase.args,
		shardsAtomic.name:    shardsAtomic.args,
		shardsTwoPhase.name:  shardsTwoPhase.args,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s := servertest.Start(t, servertest.Build(t), append(flags(t), "-ttl", "2s", "-max-lease", "1s")...)
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
			call := func(key string) (*paymentsv1.Charge, bool, time.Time) {
				t.Helper()
				charge, trailer, err := create(s, key, req)
				if err != nil {
					t.Fatalf("CreateCharge: %v", err)
				}
				expires, ok := idemkey.ParseExpires(trailer.Get(idemkey.ExpiresMetadata))
				if !ok {
					t.Fatalf("CreateCharge told no expiry: trailer %v", trailer)
				}
				return charge, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), expires
			}

			// A call and its retry within the key's two seconds. The expiry
			// told is whole seconds, at most the record's own: a retry
			// answered before it is never run again, and one that a busy
			// machine sends later may be; then a new key tries again.
			var (
				key     string
				first   *paymentsv1.Charge
				expires time.Time
			)
			for attempt := 1; first == nil; attempt++ {
				key = idemkey.NewKey()
				charge, replayed, exp := call(key)
				if replayed {
					t.Fatal("a new key's first call was replayed")
				}
				again, replayed, _ := call(key)
				switch {
				case replayed && !proto.Equal(again, charge):
					t.Fatalf("the retry replayed %v, want the first call's %v", again, charge)
				case replayed:
					first, expires = charge, exp
				case time.Now().Before(exp):
					t.Fatalf("the retry ran again (charge %s) before the key's expiry, %v", again.GetId(), exp)
				case attempt == 5:
					t.Fatal("five retries in a row came after their key's expiry")
				}
			}

			// Past the expiry, the key is new. Until then each retry replays.
			time.Sleep(time.Until(expires))
			for deadline := time.Now().Add(time.Minute); ; time.Sleep(100 * time.Millisecond) {
				charge, replayed, exp := call(key)
				if replayed {
					if !proto.Equal(charge, first) {
						t.Fatalf("a retry replayed %v, want the first call's %v", charge, first)
					}
					if time.Now().After(deadline) {
						t.Fatalf("the key still replays a minute after its expiry, %v", expires)
					}
					continue
				}
				if time.Now().Before(expires) {
					t.Fatalf("the key ran again before its expiry, %v", expires)
				}
				if charge.GetId() == first.GetId() || !exp.After(expires) {
					t.Fatalf("after the expiry: charge %s expiring %v, want a new charge (not %s) with a later expiry than %v", charge.GetId(), exp, first.GetId(), expires)
				}
				break
			}
		})
	}
}
