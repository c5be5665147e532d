// Command server runs the example payment service behind the idemkey
// interceptor.
//
//	go run ./example/server [-addr 127.0.0.1:50051] [-addr-file PATH] [-database-url URL] [-atomic=true] [-idempotency=true] [-in-transaction] [-handler-delay 0s]
//	    [-ttl 24h] [-max-lease 10m] [-lease 1m] [-method-retention METHOD=DURATION]... [-cover-method METHOD]...
//	    [-memory-max-records N] [-memory-max-bytes N] [-log-level info] [-pprof-addr ADDR]
//	    [-metrics-addr ADDR] [-metrics-addr-file PATH] [-http-addr ADDR] [-http-addr-file PATH]
//	    [-redis-url URL | -redis-cluster ADDR,ADDR,... | -spanner projects/P/instances/I/databases/D |
//	     -shard-database-urls URL,URL,...]
//	    [-seal-key FILE [-seal-previous-key FILE]... [-seal-accept-unsealed]] [-region NAME]
//	    [-processor-url URL] [-processor-timeout 5s] [-reconcile=true] [-fail-after-charge N] [-fail-after-write N]
//	    [-outbox URL [-outbox-destination payments.charge.created] [-relay=true | -relay-only] [-relay-rate N]]
//
// With -addr 127.0.0.1:0 the server listens on a free port; -addr-file names
// a file where it writes the address it listens on once it serves, which is
// how make demo finds its own server and never another that holds a port.
//
// With a database URL (the flag, else $DATABASE_URL) the idempotency keys and
// the charges live in PostgreSQL: the server creates its tables, sweeps
// expired keys every minute, and any number of servers on one database behave
// as one service. CreateCharge then runs in idemkey's atomic mode, the charge
// and its recorded reply committing in one transaction, unless -atomic=false
// asks for the two-phase mode, so that both can be tried side by side.
// Without a database URL, keys and charges live in memory, in two-phase mode;
// the keys' store is bounded by -memory-max-records and -memory-max-bytes, of
// which one tenant may hold half, and a new key is refused with
// ResourceExhausted unless there is room for its largest reply (4 MiB) too.
//
// With -idempotency=false the server runs the same service, handler and
// ledger with no idempotency at all: no interceptor, no store, no tables but
// the charges'. It is the baseline make load measures idemkey against; it
// serves gRPC only, so it takes neither -http-addr nor a Redis flag. With
// -in-transaction too, on PostgreSQL, each call runs in a transaction of its
// own (BEGIN, the charge's INSERT, COMMIT): the baseline of atomic mode,
// which has its round trips and its single commit.
//
// With -redis-url (one Redis server) or -redis-cluster (seed addresses of a
// Redis Cluster) the idempotency keys live in Redis (store/redis), which
// expires them itself; the charges stay in memory, or in PostgreSQL with a
// database URL. Redis cannot commit a charge with its reply, so CreateCharge
// runs two-phase.
//
// With -spanner (a Cloud Spanner database; the Go client goes to
// SPANNER_EMULATOR_HOST when it is set) the idempotency keys and the charges
// live in Spanner (store/spanner): the server creates their tables, and
// CreateCharge runs in atomic mode, the charge committing with its recorded
// reply in one Spanner transaction, unless -atomic=false. It takes no
// database URL or Redis flag.
// With -shard-database-urls (and -database-url= empty) the idempotency keys
// and the charges are sharded by tenant over those PostgreSQL databases
// (store/pgshard, each migrated as with a database URL): each tenant's keys
// and charges live on its shard, and in atomic mode (the default) a charge
// commits with its recorded reply in the shard's transaction. Sweeping and
// Listen run on every shard; it takes no -outbox.
//
// With -metrics-addr the server serves its metrics in the Prometheus text
// format on http://ADDR/metrics, through OpenTelemetry's Prometheus exporter:
// gRPC's own (otelgrpc) and idemkey's, idemkey_calls_total by outcome among
// them. -metrics-addr-file is -addr-file's counterpart for that address; it
// is written before the -addr-file.
//
// With -http-addr the server also serves HTTP/1.1 and h2c on that address:
// the PaymentService through connect-go (the Connect, gRPC and gRPC-Web
// protocols) and its HTTP API through grpc-gateway: POST /v1/charges, which
// takes a JSON body of CreateChargeRequest's fields and answers 201 with the
// charge, or an RFC 9457 problem, GET /v1/charges/{id} and GET
// /v1/customers/{customer_id}/charges (see example.NewHTTPHandler). What
// became of a key, without its request, is idemkey.v1.KeyService's GetKey,
// over gRPC on -addr and over Connect on -http-addr, and GET
// /v1/idempotency-keys/{key}?operation=/example.payments.v1.PaymentService/CreateCharge
// on -http-addr (POST /v1/charges's keys are CreateCharge's, the method it
// calls). All the entry points run
// on one engine (example.NewEngine), so they share its store, settings and
// scope: a key first used over any of them replays the same charge over the
// others. -http-addr-file is -addr-file's counterpart, written before it.
//
// With -seal-key the recorded replies are sealed at rest (package seal:
// AES-256-GCM, bound to each record's key) with the key in FILE: 32 bytes,
// or their hex or base64; make one with head -c 32 /dev/urandom. Each
// -seal-previous-key FILE adds a key that still opens the records it sealed
// and never seals, for a rotation; -seal-accept-unsealed replays records
// written before sealing was turned on, which are refused otherwise. A
// record the server's keys cannot open is answered Unavailable
// (IDEMPOTENCY_STORE_UNAVAILABLE) and logged at Error; nothing runs again.
// The server logs the ids of its keys at start-up, never the keys.
//
// CreateCharge charges the customer at a card processor (example.Processor,
// which does not honour idempotency keys) as a recorded step, then writes
// the charge: the processor at -processor-url, else one the server serves
// itself on a loopback port of its own. A retry of the key, after a crash
// between the processor's charge and the write or a released failure, gets
// the processor's id of the charge rather than charge again; a step an
// earlier run left started is looked up at the processor by its key, unless
// -reconcile=false, which answers it outcome unknown (gRPC Unknown,
// IDEMPOTENCY_OUTCOME_UNKNOWN) until an operator resolves it (idemkey
// resolve-step). -processor-timeout bounds each call to the processor;
// -handler-delay waits after its answer and before the charge's write, so
// that a crash can fall between them; -fail-after-charge N fails the first N
// calls with Unavailable there: a transient failure, which a retry recovers
// from.
//
// -fail-after-write N fails the first N calls with Unavailable after the
// charge's write: in atomic mode the charge rolls back, with its message.
//
// With -outbox URL (nats://host:port, amqp://user:pass@host:port/ or
// kafka://host:port[,host:port]) CreateCharge announces each charge it
// writes: a message to -outbox-destination (payments.charge.created),
// example.ChargeCreated in JSON with the header "tenant", written through
// idemkey's outbox (package outbox) in the call's transaction, with the
// charge's INSERT: -outbox needs atomic mode (the ledger's two-phase writes
// are not idempotent by themselves: a retry after their commit would write
// a second charge, whose message the outbox drops as the first's). The
// message exists if and only if the charge does, and its id
// derives from the call's key, so a re-run of the call makes the same id. A
// relay in the process sends the committed messages to the broker (where it
// creates, if missing, a JetStream stream of the subject, a durable quorum
// queue, or a topic) and marks each sent once the broker confirmed it; the
// service does not wait for the broker, whose messages wait in the outbox
// while it is away. With -relay=false the process runs no relay, and
// another process runs it: the same command with -relay-only, which serves
// nothing but the relay (and -metrics-addr), on the same database URL.
// -relay-rate bounds the relay's messages a second (outbox.WithRate), for a
// broker's rate limit; 0, the default, sends as fast as the broker confirms.
// The outbox needs PostgreSQL: the server refuses -outbox on memory or
// Redis.
//
// -ttl is how long a recorded reply is replayed, from the first call; after
// it the key runs as a new call. -max-lease bounds how long a call holds its
// key before a retry may presume it dead and run it again (a call with a
// deadline holds it for its time left plus 5s), and -lease is how long a
// call without a deadline holds it, cut to -max-lease. A record must not
// expire while its call may still hold the key, so -ttl is at least
// -max-lease: to watch a key expire, shorten both, as in
//
//	go run ./example/server -database-url= -ttl 2s -max-lease 1s
//
// where a retry within two seconds of a key's first call replays its
// reply, and one after runs again: a second charge.
//
// -method-retention METHOD=DURATION keeps the keys of one method for their
// own time, in place of -ttl, on every entry point (gRPC, Connect and the
// gateway's routes, which record under the gRPC method's name): the expiry
// told, the refusal of a stale retry and the sweep follow it. It repeats,
// a method each; like -ttl, each is at least -max-lease. -cover-method
// METHOD covers a method whatever its idempotency_level says (it repeats
// too): GetCharge, NO_SIDE_EFFECTS and so not covered by default, is then
// keyed and recorded as CreateCharge is, and its calls need a key. So
//
//	go run ./example/server -method-retention /example.payments.v1.PaymentService/CreateCharge=744h \
//	    -cover-method /example.payments.v1.PaymentService/GetCharge \
//	    -method-retention /example.payments.v1.PaymentService/GetCharge=1h
//
// keeps CreateCharge's keys 31 days, GetCharge's an hour, and any other
// covered method's -ttl.
//
// The server refuses to start, naming the flag, when a flag makes no sense:
// a -ttl, -max-lease or -lease of zero or less; a -ttl shorter than
// -max-lease; a negative -handler-delay, -fail-after-charge or
// -fail-after-write; -outbox without PostgreSQL, or -relay-only without
// -outbox; a
// -processor-timeout of zero or less; a -memory-max-records or
// -memory-max-bytes below 1; a -method-retention or -cover-method of a
// method the service does not have, a -method-retention of a method not
// covered, or shorter than -max-lease (the interceptor's own refusal).
//
// CreateCharge takes its key from the idempotency-key metadata (the
// Idempotency-Key header over HTTP) or from the request's request_id
// (AIP-155).
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
	"math"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	otelprometheus "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
	idemspanner "github.com/idemkey/idemkey/store/spanner"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:50051", "address to listen on; port 0 picks a free port")
	addrFile := flag.String("addr-file", "", "if set, write the address listened on to this file once serving, and remove it on exit")
	databaseURL := flag.String("database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL for the idempotency keys and the charges; empty keeps both in memory")
	delay := flag.Duration("handler-delay", 0, "how long CreateCharge waits after the processor's answer, before writing the charge")
	ttl := flag.Duration("ttl", engine.DefaultRetention, "how long a recorded reply is replayed; at least -max-lease")
	maxLease := flag.Duration("max-lease", engine.DefaultMaxLease, "the longest a call holds its key before a retry may presume it dead and run it again; at most -ttl")
	lease := flag.Duration("lease", engine.DefaultLease, "how long a call without a deadline holds its key; cut to -max-lease")
	var methodRetention map[string]time.Duration
	flag.Func("method-retention", "METHOD=DURATION: keep the keys of METHOD (/package.Service/Method) for DURATION in place of -ttl; at least -max-lease (repeatable)", func(v string) error {
		method, d, err := parseMethodRetention(v)
		if err != nil {
			return err
		}
		if methodRetention == nil {
			methodRetention = map[string]time.Duration{}
		}
		methodRetention[method] = d
		return nil
	})
	var coverMethods []string
	flag.Func("cover-method", "cover METHOD (/package.Service/Method) whatever its idempotency_level, such as GetCharge; its calls then need a key (repeatable)", func(method string) error {
		coverMethods = append(coverMethods, method)
		return nil
	})
	atomic := flag.Bool("atomic", true, "on PostgreSQL, commit each charge and its recorded reply in one transaction; false runs two-phase")
	idempotency := flag.Bool("idempotency", true, "false serves the same service with no idempotency interceptor or store, as a baseline")
	inTransaction := flag.Bool("in-transaction", false, "with -idempotency=false on PostgreSQL, run each call in a transaction of its own: atomic mode's baseline")
	maxRecords := flag.Int("memory-max-records", memory.DefaultMaxRecords, "without a database, the most idempotency records kept in memory; at least 1")
	maxBytes := flag.Int64("memory-max-bytes", memory.DefaultMaxBytes, "without a database, the most bytes of idempotency records kept in memory; at least 1")
	var level slog.Level
	flag.TextVar(&level, "log-level", slog.LevelInfo, "the least level logged: debug, info, warn or error")
	pprofAddr := flag.String("pprof-addr", "", "if set, serve net/http/pprof's profiles on this address, for make load")
	metricsAddr := flag.String("metrics-addr", "", "if set, serve the metrics in the Prometheus text format on http://ADDR/metrics; port 0 picks a free port")
	metricsAddrFile := flag.String("metrics-addr-file", "", "with -metrics-addr, write the metrics address listened on to this file once serving, and remove it on exit")
	httpAddr := flag.String("http-addr", "", "if set, also serve the service over HTTP on this address: Connect, gRPC-Web and the HTTP API (POST /v1/charges, through grpc-gateway); port 0 picks a free port")
	httpAddrFile := flag.String("http-addr-file", "", "with -http-addr, write the HTTP address listened on to this file once serving, and remove it on exit")
	redisURL := flag.String("redis-url", "", "Redis URL (redis://host:port/db) for the idempotency keys; runs two-phase")
	redisCluster := flag.String("redis-cluster", "", "comma-separated seed addresses of a Redis Cluster for the idempotency keys; runs two-phase")
	region := flag.String("region", "", "this server's region (lower-case letters, digits, '-'): a key first sent to another region (Idempotency-First-Region) runs nothing here until that region's record has arrived (docs/regions.md)")
	spannerDB := flag.String("spanner", "", "Cloud Spanner database (projects/P/instances/I/databases/D) for the idempotency keys and the charges; SPANNER_EMULATOR_HOST for the emulator")
	var shardURLs []string
	flag.Func("shard-database-urls", "comma-separated PostgreSQL URLs of the shards for the idempotency keys and the charges, each tenant on one (store/pgshard); needs -database-url empty", func(v string) error {
		shardURLs = strings.Split(v, ",")
		return nil
	})
	sealKey := flag.String("seal-key", "", "if set, seal the recorded replies with the key in this file (32 bytes, or their hex or base64)")
	var previousKeys []string
	flag.Func("seal-previous-key", "with -seal-key, a key file whose records still open, never used to seal (repeatable)", func(path string) error {
		previousKeys = append(previousKeys, path)
		return nil
	})
	acceptUnsealed := flag.Bool("seal-accept-unsealed", false, "with -seal-key, replay records written before sealing was turned on")
	processorURL := flag.String("processor-url", "", "the card processor's base URL; empty serves one in the process, on a loopback port")
	processorTimeout := flag.Duration("processor-timeout", 5*time.Second, "how long a call to the processor may take")
	reconcile := flag.Bool("reconcile", true, "look up at the processor a charge an earlier run started and never finished; false answers it outcome unknown")
	failAfterCharge := flag.Int("fail-after-charge", 0, "fail the first N calls with Unavailable after the processor's charge, before the write")
	failAfterWrite := flag.Int("fail-after-write", 0, "fail the first N calls with Unavailable after the charge's write: in atomic mode the charge and its message roll back")
	outboxURL := flag.String("outbox", "", "announce each charge through the outbox to this broker: nats://host:port, amqp://user:pass@host:port/ or kafka://host:port; needs PostgreSQL")
	outboxDestination := flag.String("outbox-destination", example.ChargeCreatedDestination, "with -outbox, the subject, queue or topic the charges are announced to")
	relay := flag.Bool("relay", true, "with -outbox, run the relay that sends the outbox's messages in this process; false leaves it to another (-relay-only)")
	relayOnly := flag.Bool("relay-only", false, "with -outbox, run only the relay: no service, no listener")
	relayRate := flag.Float64("relay-rate", 0, "with -outbox, the most messages a second the relay sends (a broker's rate limit); 0: no bound")
	flag.Parse()

	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	cfg := config{databaseURL: *databaseURL, addrFile: *addrFile, metricsAddr: *metricsAddr, metricsAddrFile: *metricsAddrFile, httpAddr: *httpAddr, httpAddrFile: *httpAddrFile, delay: *delay, ttl: *ttl, maxLease: *maxLease, lease: *lease,
		methodRetention: methodRetention, coverMethods: coverMethods, atomic: *atomic, bare: !*idempotency, inTransaction: *inTransaction, maxRecords: *maxRecords, maxBytes: *maxBytes, redisURL: *redisURL, redisCluster: *redisCluster, spanner: *spannerDB, shardURLs: shardURLs, region: *region,
		sealKey: *sealKey, previousKeys: previousKeys, acceptUnsealed: *acceptUnsealed,
		processorURL: *processorURL, processorTimeout: *processorTimeout, withoutReconcile: !*reconcile, failAfterCharge: *failAfterCharge, failAfterWrite: *failAfterWrite,
		outboxURL: *outboxURL, outboxDestination: *outboxDestination, relay: *relay, relayOnly: *relayOnly, relayRate: *relayRate}
	if err := cfg.check(); err != nil {
		logger.Error("server not started: a flag makes no sense", "error", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if *pprofAddr != "" {
		servePprof(*pprofAddr, logger)
	}
	var err error
	if cfg.relayOnly {
		err = runRelayOnly(ctx, cfg, logger)
	} else {
		var lis net.Listener
		if lis, err = net.Listen("tcp", *addr); err == nil {
			err = run(ctx, lis, cfg, logger)
		}
	}
	if err != nil {
		logger.Error("server stopped", "error", err)
		os.Exit(1)
	}
}

// servePprof serves net/http/pprof's handlers on addr in the background, on
// a mux of their own rather than http.DefaultServeMux, and logs the address
// it listens on (addr may have port 0).
func servePprof(addr string, logger *slog.Logger) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		logger.Error("pprof not served", "error", err)
		return
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	logger.Info("pprof listening", "addr", lis.Addr().String())
	go func() { logger.Error("pprof stopped", "error", http.Serve(lis, mux)) }()
}

// metrics is the MeterProvider of -metrics-addr and the HTTP server that
// exports it.
type metrics struct {
	provider *sdkmetric.MeterProvider
	addr     string // listened on
	server   *http.Server
	served   chan struct{} // closed once server.Serve has returned
}

// serveMetrics serves an OpenTelemetry MeterProvider's metrics in the
// Prometheus text format on http://addr/metrics, in the background, and logs
// the address it listens on (addr may have port 0). The exporter registers
// with a registry of its own, so that nothing else registered with the
// global one (Go runtime collectors, a library's metrics) is exported.
func serveMetrics(addr string, logger *slog.Logger) (*metrics, error) {
	registry := prometheus.NewRegistry()
	exporter, err := otelprometheus.New(otelprometheus.WithRegisterer(registry))
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	m := &metrics{
		provider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter)),
		addr:     lis.Addr().String(),
		server:   &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second},
		served:   make(chan struct{}),
	}
	go func() {
		defer close(m.served)
		if err := m.server.Serve(lis); err != http.ErrServerClosed {
			logger.Error("metrics stopped", "error", err)
		}
	}()
	logger.Info("metrics listening", "addr", m.addr, "url", "http://"+m.addr+"/metrics")
	return m, nil
}

// stop closes the HTTP server and shuts the MeterProvider down.
func (m *metrics) stop() {
	m.server.Close()
	<-m.served
	_ = m.provider.Shutdown(context.Background())
}

// httpServer serves the HTTP entry points of -http-addr.
type httpServer struct {
	addr   string // listened on
	server *http.Server
	conn   *grpc.ClientConn // the plain route's, to the gRPC service
	served chan struct{}    // closed once server.Serve has returned
	once   sync.Once
}

// serveHTTP serves example.NewHTTPHandler on eng and addr, over HTTP/1.1 and
// h2c, in the background; its plain route calls the gRPC service at grpcAddr.
func serveHTTP(addr string, eng *engine.Engine, cfg example.Config, grpcAddr string, logger *slog.Logger) (*httpServer, error) {
	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("http: %w", err)
	}
	handler, err := example.NewHTTPHandler(eng, cfg, conn)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("http: %w", err)
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("http: %w", err)
	}
	h := &httpServer{
		addr:   lis.Addr().String(),
		server: &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: time.Minute, IdleTimeout: 2 * time.Minute, Protocols: new(http.Protocols)},
		conn:   conn,
		served: make(chan struct{}),
	}
	h.server.Protocols.SetHTTP1(true)
	h.server.Protocols.SetUnencryptedHTTP2(true)
	go func() {
		defer close(h.served)
		if err := h.server.Serve(lis); err != http.ErrServerClosed {
			logger.Error("http stopped", "error", err)
		}
	}()
	logger.Info("http listening", "addr", h.addr, "connect", "http://"+h.addr+"/example.payments.v1.PaymentService/", "charges", "POST http://"+h.addr+"/v1/charges")
	return h, nil
}

// stop lets the calls in flight end, for at most 10s, then closes.
func (h *httpServer) stop() {
	h.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if h.server.Shutdown(ctx) != nil {
			h.server.Close()
		}
		<-h.served
		h.conn.Close()
	})
}

// processor is the example.Processor a server without -processor-url
// serves itself.
type processor struct {
	*http.Server
	url    string
	served chan struct{} // closed once Serve has returned
}

// serveProcessor serves an example.Processor on a free loopback port, in
// the background, until its Close.
func serveProcessor(logger *slog.Logger) (*processor, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("processor: %w", err)
	}
	p := &processor{
		Server: &http.Server{Handler: example.NewProcessor(0, false), ReadHeaderTimeout: 10 * time.Second},
		url:    "http://" + lis.Addr().String(),
		served: make(chan struct{}),
	}
	go func() {
		defer close(p.served)
		_ = p.Serve(lis)
	}()
	logger.Info("processor listening", "url", p.url)
	return p, nil
}

// Close stops the processor and its connections.
func (p *processor) Close() {
	p.Server.Close()
	<-p.served
}

// config is what the flags set.
type config struct {
	databaseURL string
	addrFile    string // written once serving, removed on return
	// metricsAddr, if set, is where /metrics is served; metricsAddrFile, if
	// set, gets the address taken, before addrFile.
	metricsAddr, metricsAddrFile string
	// httpAddr, if set, is where the HTTP entry points are served;
	// httpAddrFile, if set, gets the address taken, before addrFile.
	httpAddr, httpAddrFile string
	delay, ttl             time.Duration
	// maxLease and lease are the engine's WithMaxLease and WithLease; 0 (a
	// config of a test's) leaves the engine's default.
	maxLease, lease time.Duration
	// methodRetention and coverMethods are example.Config's Retention and
	// Covered: each method's retention in place of ttl, and the methods
	// covered whatever their idempotency_level.
	methodRetention        map[string]time.Duration
	coverMethods           []string
	atomic                 bool  // on PostgreSQL only
	bare                   bool  // no idempotency: no interceptor, no store
	inTransaction          bool  // bare, each call in a transaction of its own
	maxRecords             int   // in memory only
	maxBytes               int64 // in memory only
	redisURL, redisCluster string
	spanner                string   // a Spanner database's name
	region                 string   // this server's region, for the fence across regions (engine.WithRegion)
	shardURLs              []string // PostgreSQL shards (store/pgshard), in place of databaseURL
	// sealKey, if set, is the key file replies are sealed with;
	// previousKeys open and never seal; acceptUnsealed replays records that
	// are not sealed.
	sealKey        string
	previousKeys   []string
	acceptUnsealed bool
	// processorURL, if set, is the card processor's; else run serves one.
	// processorTimeout of 0 (a config of a test's) is example.Config's
	// default.
	processorURL     string
	processorTimeout time.Duration
	withoutReconcile bool
	failAfterCharge  int
	failAfterWrite   int
	// outboxURL, if set, is the broker CreateCharge announces each charge
	// to through the outbox, to outboxDestination; relay runs the relay in
	// the process, and relayOnly runs nothing else.
	outboxURL, outboxDestination string
	relay, relayOnly             bool
	relayRate                    float64 // messages a second; 0: no bound
}

// check refuses the flags of cfg that make no sense, naming the flag, before
// anything listens: a -ttl, -max-lease or -lease that engine.New refuses
// (zero or less, or a -ttl shorter than -max-lease), a -method-retention or
// -cover-method that the interceptor refuses (an unknown method, a
// retention of a method not covered, or shorter than -max-lease), a
// negative -handler-delay, and memory bounds below 1, which the memory store
// would silently take for its defaults.
func (cfg config) check() error {
	switch {
	case cfg.ttl <= 0:
		return fmt.Errorf("-ttl %v: replies must be kept for a positive time; leave the flag out for %v", cfg.ttl, engine.DefaultRetention)
	case cfg.maxLease <= 0:
		return fmt.Errorf("-max-lease %v: a call must hold its key for a positive time; leave the flag out for %v", cfg.maxLease, engine.DefaultMaxLease)
	case cfg.lease <= 0:
		return fmt.Errorf("-lease %v: a call must hold its key for a positive time; leave the flag out for %v", cfg.lease, engine.DefaultLease)
	case cfg.ttl < cfg.maxLease:
		return fmt.Errorf("-ttl %v is shorter than -max-lease %v: a record would expire while its call may still hold the key; "+
			"lengthen -ttl or shorten -max-lease (-ttl 2s -max-lease 1s shows a key expiring)", cfg.ttl, cfg.maxLease)
	}
	if cfg.region != "" {
		if err := idemkey.ValidateRegion(cfg.region); err != nil {
			return fmt.Errorf("-region %q: %w", cfg.region, err)
		}
	}
	eng, err := example.NewEngine(memory.New(), cfg.keyOptions()...)
	if err != nil {
		return fmt.Errorf("-ttl %v, -max-lease %v, -lease %v: %w", cfg.ttl, cfg.maxLease, cfg.lease, err)
	}
	// The interceptor's own check of the methods' coverage and retention,
	// on the engine's settings: a server built as run builds it, never
	// served.
	if len(cfg.methodRetention) > 0 || len(cfg.coverMethods) > 0 {
		srv, _, err := example.NewServer(eng, example.Config{Covered: cfg.coverMethods, Retention: cfg.methodRetention})
		if err != nil {
			return fmt.Errorf("-method-retention or -cover-method (each retention at least -max-lease %v): %w", cfg.maxLease, err)
		}
		srv.Stop()
	}
	switch {
	case cfg.delay < 0:
		return fmt.Errorf("-handler-delay %v: a delay cannot be negative; 0 holds no call", cfg.delay)
	case cfg.processorTimeout <= 0:
		return fmt.Errorf("-processor-timeout %v: a call to the processor needs a positive time; leave the flag out for 5s", cfg.processorTimeout)
	case cfg.failAfterCharge < 0:
		return fmt.Errorf("-fail-after-charge %d: a count cannot be negative; 0 fails no call", cfg.failAfterCharge)
	case cfg.failAfterWrite < 0:
		return fmt.Errorf("-fail-after-write %d: a count cannot be negative; 0 fails no call", cfg.failAfterWrite)
	case cfg.maxRecords < 1:
		return fmt.Errorf("-memory-max-records %d: the memory store needs room for at least 1 record; leave the flag out for %d", cfg.maxRecords, memory.DefaultMaxRecords)
	case cfg.maxBytes < 1:
		return fmt.Errorf("-memory-max-bytes %d: the memory store needs room for at least 1 byte; leave the flag out for %d (64 MiB)", cfg.maxBytes, memory.DefaultMaxBytes)
	}
	if err := cfg.checkShards(); err != nil {
		return err
	}
	return cfg.checkOutbox()
}

// checkOutbox refuses -outbox where the outbox cannot be, and the relay's
// flags without it.
func (cfg config) checkOutbox() error {
	if cfg.outboxURL == "" {
		if cfg.relayOnly {
			return errors.New("-relay-only runs the relay of an outbox: it needs -outbox and a database URL")
		}
		return nil
	}
	switch {
	case cfg.databaseURL == "" || cfg.redisURL != "" || cfg.redisCluster != "":
		return errors.New("-outbox needs PostgreSQL (a database URL, without -redis-url or -redis-cluster): a charge's message is written in the transaction of its INSERT, in the idemkey store's database")
	case cfg.bare:
		return errors.New("-outbox needs idempotency: a message's id derives from the call's key; -idempotency=false takes no -outbox")
	case !cfg.atomic && !cfg.relayOnly:
		return errors.New("-outbox needs atomic mode (-atomic, the default): in two-phase mode a retry after the ledger's commit and before the key's record " +
			"writes a second charge, whose message, of the first's id, the outbox drops (docs/outbox.md, Two-phase mode)")
	case cfg.relayOnly && !cfg.relay:
		return errors.New("-relay-only with -relay=false would run nothing")
	case cfg.outboxDestination == "":
		return errors.New("-outbox-destination: a subject, queue or topic is needed")
	case !(cfg.relayRate >= 0) || math.IsInf(cfg.relayRate, 0):
		return errors.New("-relay-rate: want a number of messages a second, or 0 for no bound")
	}
	return checkOutboxURL(cfg.outboxURL)
}

// parseMethodRetention parses -method-retention's METHOD=DURATION.
func parseMethodRetention(v string) (string, time.Duration, error) {
	method, duration, ok := strings.Cut(v, "=")
	if !ok || method == "" {
		return "", 0, errors.New("want METHOD=DURATION, such as /example.payments.v1.PaymentService/CreateCharge=744h")
	}
	d, err := time.ParseDuration(duration)
	if err != nil {
		return "", 0, fmt.Errorf("%s: want a duration, such as 744h: %w", method, err)
	}
	if d <= 0 {
		return "", 0, fmt.Errorf("%s=%v: keys must be kept for a positive time; leave the flag out for -ttl", method, d)
	}
	return method, d, nil
}

// keyOptions are the engine's options for how long a key is held and kept.
func (cfg config) keyOptions() []engine.Option {
	opts := []engine.Option{engine.WithRetention(cfg.ttl)}
	if cfg.maxLease != 0 {
		opts = append(opts, engine.WithMaxLease(cfg.maxLease))
	}
	if cfg.lease != 0 {
		opts = append(opts, engine.WithLease(cfg.lease))
	}
	if cfg.region != "" {
		opts = append(opts, engine.WithRegion(cfg.region))
	}
	return opts
}

// keyRing reads the key files of cfg: nil without -seal-key.
func keyRing(cfg config) (*seal.KeyRing, error) {
	if cfg.sealKey == "" {
		if len(cfg.previousKeys) > 0 || cfg.acceptUnsealed {
			return nil, errors.New("-seal-previous-key and -seal-accept-unsealed need -seal-key")
		}
		return nil, nil
	}
	primary, err := seal.ReadKeyFile(cfg.sealKey)
	if err != nil {
		return nil, fmt.Errorf("-seal-key: %w", err)
	}
	opts := []seal.Option{}
	for _, path := range cfg.previousKeys {
		k, err := seal.ReadKeyFile(path)
		if err != nil {
			return nil, fmt.Errorf("-seal-previous-key: %w", err)
		}
		opts = append(opts, seal.WithPreviousKeys(k))
	}
	if cfg.acceptUnsealed {
		opts = append(opts, seal.WithUnsealedAccepted())
	}
	return seal.NewKeyRing(primary, opts...)
}

// run serves on lis until ctx is done, then stops gracefully.
func run(ctx context.Context, lis net.Listener, cfg config, logger *slog.Logger) error {
	defer lis.Close()
	var (
		m       *metrics // nil without -metrics-addr
		meters  metric.MeterProvider
		srvOpts []grpc.ServerOption
	)
	if cfg.metricsAddr != "" {
		var err error
		if m, err = serveMetrics(cfg.metricsAddr, logger); err != nil {
			return err
		}
		defer m.stop()
		meters = m.provider
		srvOpts = append(srvOpts, grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithMeterProvider(meters))))
	}
	var (
		st     store.Store    = memory.New(memory.WithMaxRecords(cfg.maxRecords), memory.WithMaxBytes(cfg.maxBytes))
		ledger example.Ledger = example.NewMemoryLedger()
		kind                  = "memory"
		mode                  = "two-phase"
	)
	if cfg.bare && (cfg.httpAddr != "" || cfg.redisURL != "" || cfg.redisCluster != "" || cfg.sealKey != "" || len(cfg.methodRetention) > 0 || len(cfg.coverMethods) > 0) {
		return errors.New("-idempotency=false serves gRPC only, with no store: it takes neither -http-addr nor a Redis, seal, -method-retention or -cover-method flag")
	}
	if cfg.spanner != "" && (cfg.databaseURL != "" || cfg.redisURL != "" || cfg.redisCluster != "" || len(cfg.shardURLs) > 0) {
		return errors.New("-spanner keeps the keys and the charges in Spanner: it takes no database URL, -redis-url, -redis-cluster or -shard-database-urls")
	}
	if cfg.inTransaction && (!cfg.bare || cfg.databaseURL == "") {
		return errors.New("-in-transaction runs the bare server's calls in transactions: it needs -idempotency=false and a database URL")
	}
	ring, err := keyRing(cfg)
	if err != nil {
		return err
	}
	if (cfg.databaseURL == "" && cfg.spanner == "" && len(cfg.shardURLs) == 0) || cfg.redisURL != "" || cfg.redisCluster != "" || cfg.bare {
		cfg.atomic = false
	}
	if cfg.atomic {
		mode = "atomic"
	}
	if cfg.bare {
		st, mode = nil, "none"
	}
	var (
		pool     *pgxpool.Pool
		pgLedger *example.PostgresLedger
	)
	if cfg.databaseURL != "" {
		var err error
		pool, err = example.OpenDatabase(ctx, cfg.databaseURL, !cfg.bare, logger)
		if err != nil {
			return err
		}
		defer pool.Close()
		pgLedger = example.NewPostgresLedger(pool)
		ledger, kind = pgLedger, "postgres"
	}
	if cfg.spanner != "" {
		client, spLedger, err := example.OpenSpanner(ctx, cfg.spanner, !cfg.bare, logger)
		if err != nil {
			return err
		}
		defer client.Close()
		ledger, kind = spLedger, "spanner"
		if !cfg.bare {
			if st, err = idemspanner.New(client, idemspanner.WithLogger(logger)); err != nil {
				return err
			}
		}
	}
	if len(cfg.shardURLs) > 0 {
		sst, sharded, closeShards, err := openShards(ctx, cfg, logger, meters)
		if err != nil {
			return err
		}
		defer closeShards()
		st, ledger, kind = sst, sharded, fmt.Sprintf("pgshard (%d shards)", len(cfg.shardURLs))
	}
	if cfg.redisURL != "" || cfg.redisCluster != "" {
		rst, closeRedis, err := example.OpenRedis(ctx, cfg.redisURL, cfg.redisCluster, logger)
		if err != nil {
			return err
		}
		defer closeRedis()
		st, kind = rst, "redis"
	} else if cfg.databaseURL != "" && !cfg.bare {
		pst, err := postgres.New(pool, postgres.WithLogger(logger))
		if err != nil {
			return err
		}
		st = pst
		janitor := &store.Janitor{Store: pst, Logger: logger, MeterProvider: meters}
		defer example.Background(ctx, janitor.Run, pst.Listen)()
		if cfg.outboxURL != "" {
			ob, err := outbox.New(pst, outbox.WithSealer(ring))
			if err != nil {
				return err
			}
			pgLedger.Announce(ob, cfg.outboxDestination)
			if cfg.relay {
				opts := []outbox.RelayOption{outbox.WithLogger(logger), outbox.WithMeterProvider(meters), outbox.WithRate(cfg.relayRate)}
				defer example.Background(ctx, func(ctx context.Context) error { return runRelay(ctx, ob, cfg, opts, logger) })()
			}
		}
	}

	// One engine for every entry point: they share its settings, and a key
	// first used over one replays over the others.
	engOpts := append(cfg.keyOptions(), engine.WithLogger(logger), engine.WithMeterProvider(meters))
	sealing := "off"
	if ring != nil {
		engOpts = append(engOpts, engine.WithSealer(ring))
		sealing = "key " + ring.PrimaryKeyID()
		if ids := ring.KeyIDs(); len(ids) > 1 {
			sealing += ", opening " + strings.Join(ids[1:], ", ") + " too"
		}
		if cfg.acceptUnsealed {
			sealing += ", replaying unsealed records"
		}
	}
	var eng *engine.Engine // nil with -idempotency=false
	if !cfg.bare {
		if eng, err = example.NewEngine(st, engOpts...); err != nil {
			return err
		}
	}
	if cfg.processorURL == "" {
		p, err := serveProcessor(logger)
		if err != nil {
			return err
		}
		defer p.Close()
		cfg.processorURL = p.url
	}
	shared := example.Config{HandlerDelay: cfg.delay, Ledger: ledger, Atomic: cfg.atomic, Covered: cfg.coverMethods, Retention: cfg.methodRetention,
		ProcessorURL: cfg.processorURL, ProcessorTimeout: cfg.processorTimeout, WithoutReconcile: cfg.withoutReconcile, FailAfterCharge: cfg.failAfterCharge,
		FailAfterWrite: cfg.failAfterWrite}
	grpcCfg := shared
	grpcCfg.ServerOptions, grpcCfg.WithoutIdempotency, grpcCfg.InTransaction = srvOpts, cfg.bare, cfg.inTransaction
	srv, hs, err := example.NewServer(eng, grpcCfg)
	if err != nil {
		return err
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	announce := "off"
	if cfg.outboxURL != "" {
		announce = brokerName(cfg.outboxURL) + ", relay in this process"
		if !cfg.relay {
			announce = brokerName(cfg.outboxURL) + ", relay apart"
		}
	}
	logger.Info("payment service listening", "addr", lis.Addr().String(), "store", kind, "mode", mode, "handler_delay", cfg.delay, "sealing", sealing, "outbox", announce)
	var h *httpServer // nil without -http-addr
	if cfg.httpAddr != "" {
		var err error
		h, err = serveHTTP(cfg.httpAddr, eng, shared, lis.Addr().String(), logger)
		if err != nil {
			srv.Stop()
			return err
		}
		defer h.stop()
		if cfg.httpAddrFile != "" {
			defer os.Remove(cfg.httpAddrFile)
			if err := writeFileAtomic(cfg.httpAddrFile, h.addr+"\n"); err != nil {
				srv.Stop()
				return fmt.Errorf("http-addr-file: %w", err)
			}
		}
	}
	// The metrics address first: whoever waits for the addr-file finds both.
	if m != nil && cfg.metricsAddrFile != "" {
		defer os.Remove(cfg.metricsAddrFile)
		if err := writeFileAtomic(cfg.metricsAddrFile, m.addr+"\n"); err != nil {
			srv.Stop()
			return fmt.Errorf("metrics-addr-file: %w", err)
		}
	}
	if cfg.addrFile != "" {
		defer os.Remove(cfg.addrFile)
		if err := writeFileAtomic(cfg.addrFile, lis.Addr().String()+"\n"); err != nil {
			srv.Stop()
			return fmt.Errorf("addr-file: %w", err)
		}
	}

	select {
	case err := <-served:
		srv.Stop()
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	logger.Info("shutting down")
	if h != nil {
		h.stop() // first: its plain route calls the gRPC service
	}
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

// writeFileAtomic writes data to path through a rename, so that a reader
// sees either no file or all of it.
func writeFileAtomic(path, data string) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(data), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// runRelayOnly runs the relay of -relay-only until ctx is done: the
// outbox's messages, which servers run with -relay=false write, sent to
// the broker. It serves /metrics with -metrics-addr. Stopped, even while it
// starts, it returns nil.
func runRelayOnly(ctx context.Context, cfg config, logger *slog.Logger) error {
	err := relayOnly(ctx, cfg, logger)
	if ctx.Err() != nil {
		logger.Info("shutting down")
		return nil
	}
	return err
}

func relayOnly(ctx context.Context, cfg config, logger *slog.Logger) error {
	opts := []outbox.RelayOption{outbox.WithLogger(logger), outbox.WithRate(cfg.relayRate)}
	if cfg.metricsAddr != "" {
		m, err := serveMetrics(cfg.metricsAddr, logger)
		if err != nil {
			return err
		}
		defer m.stop()
		opts = append(opts, outbox.WithMeterProvider(m.provider))
		if cfg.metricsAddrFile != "" {
			defer os.Remove(cfg.metricsAddrFile)
			if err := writeFileAtomic(cfg.metricsAddrFile, m.addr+"\n"); err != nil {
				return fmt.Errorf("metrics-addr-file: %w", err)
			}
		}
	}
	ring, err := keyRing(cfg)
	if err != nil {
		return err
	}
	pool, err := example.OpenDatabase(ctx, cfg.databaseURL, true, logger)
	if err != nil {
		return err
	}
	defer pool.Close()
	pst, err := postgres.New(pool, postgres.WithLogger(logger))
	if err != nil {
		return err
	}
	ob, err := outbox.New(pst, outbox.WithSealer(ring))
	if err != nil {
		return err
	}
	return runRelay(ctx, ob, cfg, opts, logger)
}
