package main

import (
	"context"
	"encoding/hex"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	goredis "github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/example/paymentsv1connect"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
	redisstore "github.com/idemkey/idemkey/store/redis"
	"github.com/idemkey/idemkey/tests/redistest"
)

// getChargeOp is GetCharge's method, NO_SIDE_EFFECTS: covered only by
// -cover-method.
const getChargeOp = paymentsv1.PaymentService_GetCharge_FullMethodName

// The retentions of TestRetentionPerMethod: a month of CreateCharge's keys
// (Adyen's "at least 31 days"), an hour of GetCharge's, on one engine whose
// own (-ttl) is the default day.
const (
	createRetention = 744 * time.Hour
	getRetention    = time.Hour
)

// retentionFlags cover GetCharge and give each method its retention.
var retentionFlags = []string{
	"-method-retention", createChargeOp + "=" + createRetention.String(),
	"-cover-method", getChargeOp,
	"-method-retention", getChargeOp + "=" + getRetention.String(),
}

// One server keeps CreateCharge's keys 31 days and GetCharge's an hour:
// each call over gRPC, Connect and HTTP (POST /v1/charges, GET
// /v1/charges/{id}) is told its own method's expiry, and a retry is told
// the same. On PostgreSQL (both modes) each record lasts its own time: once
// every record is two hours old, a sweep deletes GetCharge's and keeps
// CreateCharge's, whose keys still replay while GetCharge's run afresh. On
// Redis each record's own TTL is its method's retention; on Spanner and on
// three PostgreSQL shards (both modes) each record lives its method's
// retention from its creation. On memory, the expiries told.
func TestRetentionPerMethod(t *testing.T) {
	bin := servertest.Build(t)
	for _, tc := range []struct {
		name string
		open func(t *testing.T) (args []string, schema, redisAddr string)
	}{
		{"memory", func(*testing.T) ([]string, string, string) { return []string{"-database-url="}, "", "" }},
		{"postgres/atomic", func(t *testing.T) ([]string, string, string) {
			schema := pgtest.Schema(t)
			return []string{"-database-url", pgtest.SchemaURL(schema)}, schema, ""
		}},
		{"postgres/2-phase", func(t *testing.T) ([]string, string, string) {
			schema := pgtest.Schema(t)
			return []string{"-database-url", pgtest.SchemaURL(schema), "-atomic=false"}, schema, ""
		}},
		{"redis", func(t *testing.T) ([]string, string, string) {
			addr := redistest.Start(t).Addr
			return []string{"-database-url=", "-redis-url", "redis://" + addr}, "", addr
		}},
		{spannerAtomic.name, func(t *testing.T) ([]string, string, string) { return spannerAtomic.args(t), "", "" }},
		{spannerTwoPhase.name, func(t *testing.T) ([]string, string, string) { return spannerTwoPhase.args(t), "", "" }},
		{shardsAtomic.name, func(t *testing.T) ([]string, string, string) { return shardsAtomic.args(t), "", "" }},
		{shardsTwoPhase.name, func(t *testing.T) ([]string, string, string) { return shardsTwoPhase.args(t), "", "" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			args, schema, redisAddr := tc.open(t)
			s := startKeyServer(t, bin, append(args, retentionFlags...)...)
			c := &retentionClient{s: s, connect: paymentsv1connect.NewPaymentServiceClient(http.DefaultClient, s.http, connect.WithProtoJSON())}

			// Each entry point's calls, a new key each, and the key's
			// method: the charge first, which the reads then get.
			type keyed struct{ key, method string }
			var keys []keyed
			var chargeID string
			for _, via := range []string{"grpc", "connect", "http"} {
				key := idemkey.NewKey()
				id := c.create(t, via, key)
				if chargeID == "" {
					chargeID = id
				}
				keys = append(keys, keyed{key, createChargeOp})
			}
			for _, via := range []string{"grpc", "connect", "http"} {
				key := idemkey.NewKey()
				c.get(t, via, key, chargeID)
				keys = append(keys, keyed{key, getChargeOp})
			}

			switch {
			case schema != "":
				pool := pgtest.Pool(t, schema)
				ctx := context.WithoutCancel(t.Context())
				// Each record's life, as the table holds it.
				for _, k := range keys {
					hash := store.ScopeKey("acme", k.method, k.key)
					var life time.Duration
					if err := pool.QueryRow(ctx, `SELECT expires_at - created_at FROM idempotency_keys WHERE key = $1`, hash[:]).Scan(&life); err != nil {
						t.Fatalf("%s's record %s: %v", k.method, hash, err)
					}
					if want := retentionOf(k.method); life != want {
						t.Errorf("%s's record %s lives %v, want %v", k.method, hash, life, want)
					}
				}
				st, err := postgres.New(pool)
				if err != nil {
					t.Fatal(err)
				}
				if n, err := st.Sweep(ctx, 0); err != nil || n != 0 {
					t.Fatalf("a sweep of records an instant old deleted %d (%v), want none", n, err)
				}
				// Two hours on: every record (and step) two hours older.
				for _, sql := range []string{
					`UPDATE idempotency_keys SET created_at = created_at - interval '2 hours',
						expires_at = expires_at - interval '2 hours', lease_end = lease_end - interval '2 hours'`,
					`UPDATE idempotency_keys_steps SET started_at = started_at - interval '2 hours', expires_at = expires_at - interval '2 hours'`,
				} {
					if _, err := pool.Exec(ctx, sql); err != nil {
						t.Fatal(err)
					}
				}
				if _, err := st.Sweep(ctx, 0); err != nil {
					t.Fatal(err)
				}
				for _, k := range keys {
					hash := store.ScopeKey("acme", k.method, k.key)
					var n int
					if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE key = $1`, hash[:]).Scan(&n); err != nil {
						t.Fatal(err)
					}
					if want := map[string]int{createChargeOp: 1, getChargeOp: 0}[k.method]; n != want {
						t.Errorf("two hours on, after a sweep: %d records of %s's key %s, want %d", n, k.method, hash, want)
					}
				}
				// What a client sees of it: CreateCharge's keys replay,
				// GetCharge's run as new calls.
				for _, k := range keys {
					var replayed bool
					if k.method == createChargeOp {
						replayed = c.call(t, "grpc", k.key, func(ctx context.Context, opts ...grpc.CallOption) error {
							_, err := c.s.grpc().CreateCharge(ctx, acmeRequest, opts...)
							return err
						}).replayed
					} else {
						replayed = c.call(t, "grpc", k.key, func(ctx context.Context, opts ...grpc.CallOption) error {
							_, err := c.s.grpc().GetCharge(ctx, &paymentsv1.GetChargeRequest{Id: chargeID}, opts...)
							return err
						}).replayed
					}
					if want := k.method == createChargeOp; replayed != want {
						t.Errorf("two hours on, a retry of %s's key: replayed %v, want %v", k.method, replayed, want)
					}
				}
			case redisAddr != "":
				client := goredis.NewClient(&goredis.Options{Addr: redisAddr})
				defer client.Close()
				for _, k := range keys {
					hash := store.ScopeKey("acme", k.method, k.key)
					name := redisstore.DefaultPrefix + ":{" + hex.EncodeToString(hash[:]) + "}"
					ttl, err := client.PTTL(t.Context(), name).Result()
					if err != nil {
						t.Fatal(err)
					}
					// The record was written within the last minute.
					if want := retentionOf(k.method); ttl > want || ttl < want-time.Minute-margin(want) {
						t.Errorf("%s's record %s: PTTL %v, want about %v", k.method, hash, ttl, want)
					}
				}
			default:
				// Spanner and the shards: each record's life, as the
				// database holds it.
				if db := openLedger(t, args); db != nil {
					for _, k := range keys {
						hash := store.ScopeKey("acme", k.method, k.key)
						if life, want := db.life(t, hash), retentionOf(k.method); life != want {
							t.Errorf("%s's record %s lives %v, want %v", k.method, hash, life, want)
						}
					}
				}
			}
		})
	}
}

// retentionOf is the retention TestRetentionPerMethod gives method.
func retentionOf(method string) time.Duration {
	if method == getChargeOp {
		return getRetention
	}
	return createRetention
}

// margin is how far an expiry told may stray from the call's time plus
// the retention d: whole seconds (the HTTP date), a store's clock, and a
// share of d.
func margin(d time.Duration) time.Duration { return 5*time.Second + d/10000 }

// retentionClient calls the methods of a server started with
// retentionFlags, as acme.
type retentionClient struct {
	s       *keyServer
	connect paymentsv1connect.PaymentServiceClient
}

func (s *keyServer) grpc() paymentsv1.PaymentServiceClient {
	return paymentsv1.NewPaymentServiceClient(s.Conn)
}

// fate is what a call was told of its key.
type fate struct {
	replayed bool
	expires  time.Time
}

// call runs f over gRPC as acme with key and reads the key's fate from its
// header and trailer.
func (c *retentionClient) call(t *testing.T, what, key string, f func(context.Context, ...grpc.CallOption) error) fate {
	t.Helper()
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
	var header, trailer metadata.MD
	if err := f(ctx, grpc.Header(&header), grpc.Trailer(&trailer)); err != nil {
		t.Fatalf("%s over gRPC: %v", what, err)
	}
	exp, _ := idemkey.ParseExpires(append(header.Get(idemkey.ExpiresMetadata), trailer.Get(idemkey.ExpiresMetadata)...))
	return fate{replayed: idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), expires: exp}
}

// create charges acme's customer via one entry point with key, twice: each
// answer must tell CreateCharge's expiry, the first a first run and the
// second its replay. It returns the charge's id.
func (c *retentionClient) create(t *testing.T, via, key string) string {
	t.Helper()
	var id string
	c.twice(t, via, createChargeOp, func() fate {
		switch via {
		case "grpc":
			return c.call(t, "CreateCharge", key, func(ctx context.Context, opts ...grpc.CallOption) error {
				charge, err := c.s.grpc().CreateCharge(ctx, acmeRequest, opts...)
				id = charge.GetId()
				return err
			})
		case "connect":
			req := connect.NewRequest(acmeRequest)
			req.Header().Set("Authorization", "Bearer sk_test_acme")
			req.Header().Set(idemkey.KeyHeader, key)
			resp, err := c.connect.CreateCharge(t.Context(), req)
			if err != nil {
				t.Fatalf("CreateCharge over Connect: %v", err)
			}
			id = resp.Msg.GetId()
			return headerFate(t, "CreateCharge over Connect", resp.Header())
		default:
			e := &entryPoints{http: c.s.http}
			code, charge, _, header := e.viaHTTP(t, key, jsonOf(t, acmeRequest))
			if code != http.StatusCreated {
				t.Fatalf("POST /v1/charges: %d, want 201", code)
			}
			id = charge.GetId()
			return headerFate(t, "POST /v1/charges", header)
		}
	})
	return id
}

// get reads acme's charge id via one entry point with key, twice, as
// create does: each answer must tell GetCharge's expiry.
func (c *retentionClient) get(t *testing.T, via, key, id string) {
	t.Helper()
	c.twice(t, via, getChargeOp, func() fate {
		switch via {
		case "grpc":
			return c.call(t, "GetCharge", key, func(ctx context.Context, opts ...grpc.CallOption) error {
				_, err := c.s.grpc().GetCharge(ctx, &paymentsv1.GetChargeRequest{Id: id}, opts...)
				return err
			})
		case "connect":
			req := connect.NewRequest(&paymentsv1.GetChargeRequest{Id: id})
			req.Header().Set("Authorization", "Bearer sk_test_acme")
			req.Header().Set(idemkey.KeyHeader, key)
			resp, err := c.connect.GetCharge(t.Context(), req)
			if err != nil {
				t.Fatalf("GetCharge over Connect: %v", err)
			}
			return headerFate(t, "GetCharge over Connect", resp.Header())
		default:
			req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, c.s.http+"/v1/charges/"+id, nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Authorization", "Bearer sk_test_acme")
			req.Header.Set(idemkey.KeyHeader, key)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("GET /v1/charges/{id}: %d, want 200", resp.StatusCode)
			}
			return headerFate(t, "GET /v1/charges/{id}", resp.Header)
		}
	})
}

// headerFate reads a key's fate from HTTP headers (Connect's and the
// gateway's).
func headerFate(t *testing.T, what string, h http.Header) fate {
	t.Helper()
	exp, err := idemkey.ParseDate(h.Get(idemkey.ExpiresHeader))
	if err != nil {
		t.Fatalf("%s: %s %q: %v", what, idemkey.ExpiresHeader, h.Get(idemkey.ExpiresHeader), err)
	}
	return fate{replayed: idemkey.ParseReplayed(h.Values(idemkey.ReplayedHeader)), expires: exp}
}

// twice makes a call of method's and its retry: the first must run and be
// told an expiry of its method's retention from the call, the retry must
// be replayed and told the same expiry.
func (c *retentionClient) twice(t *testing.T, via, method string, call func() fate) {
	t.Helper()
	d := retentionOf(method)
	before := time.Now()
	first := call()
	after := time.Now()
	if first.replayed {
		t.Errorf("%s via %s: the first call was replayed", method, via)
	}
	if first.expires.Before(before.Add(d-margin(d))) || first.expires.After(after.Add(d+margin(d))) {
		t.Errorf("%s via %s: told expiry %v, want %v from the call (%v), within %v", method, via, first.expires, d, before, margin(d))
	}
	retry := call()
	if !retry.replayed || !retry.expires.Equal(first.expires) {
		t.Errorf("%s via %s: the retry was told %+v, want a replay with the first call's expiry %v", method, via, retry, first.expires)
	}
}
