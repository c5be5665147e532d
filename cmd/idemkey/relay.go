package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/idemamqp"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store/postgres"
)

// brokerSchemes is what -broker takes, for its usage errors.
const brokerSchemes = "nats://host:port, amqp://user:pass@host:port/vhost (or amqps://) or kafka://host:port[,host:port]"

// relayFlags are relay's own flags.
type relayFlags struct {
	broker         string
	exchange       string
	batch          int
	lease          time.Duration
	rate           float64
	retention      time.Duration
	sealKey        string
	previousKeys   []string
	acceptUnsealed bool
}

// relayed is relay's result, printed with -json once it stops.
type relayed struct {
	Table   string `json:"table"`
	Broker  string `json:"broker"` // its kind: nats, amqp or kafka
	Stopped bool   `json:"stopped"`
}

// relayCommand's flags default to the outbox.RelayOptions' defaults.
func relayCommand() command {
	var f relayFlags
	return command{
		serve:        true,
		postgresOnly: "relay sends PostgreSQL's outbox only (package outbox writes it through store/postgres): a store on Spanner has no outbox",
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&f.broker, "broker", "", "the broker to send to: "+brokerSchemes)
			fs.StringVar(&f.exchange, "exchange", "", `with amqp://, the exchange to publish to, each message's destination its routing key (default "", the default exchange: a queue's name)`)
			fs.IntVar(&f.batch, "batch", 100, "how many messages to claim and publish at once")
			fs.DurationVar(&f.lease, "lease", 30*time.Second, "how long a claim holds its messages from other relays; a publish is given half of it")
			fs.Float64Var(&f.rate, "rate", 0, "at most this many messages a second (0: as fast as the broker confirms)")
			fs.DurationVar(&f.retention, "retention", 7*24*time.Hour, "how long a sent message is kept, so that a re-run's copy of it is dropped; at least the records' retention")
			fs.StringVar(&f.sealKey, "seal-key", "", "the servers' key file (seal.ReadKeyFile), if they seal the outbox's messages (outbox.WithSealer)")
			fs.Func("seal-previous-key", "another key file of the ring, for messages sealed before a rotation (repeatable)", func(path string) error {
				f.previousKeys = append(f.previousKeys, path)
				return nil
			})
			fs.BoolVar(&f.acceptUnsealed, "seal-accept-unsealed", false, "with -seal-key, send messages written before sealing was turned on")
		},
		exec:  func(ctx context.Context, e *env) (any, error) { return f.run(ctx, e) },
		human: func(io.Writer, any) {}, // the log says it all
	}
}

// brokerURL is -broker read: its kind, and the URL to dial (kafka: the
// seed brokers).
type brokerURL struct {
	kind     string // nats, amqp, kafka
	url      string
	seeds    []string // kafka's
	password string   // never printed
}

func parseBroker(raw string) (brokerURL, error) {
	bad := func(why string) (brokerURL, error) {
		if raw == "" {
			return brokerURL{}, usageError("relay needs -broker: %s", brokerSchemes)
		}
		// Not the URL, nor a part of it: a password may hide anywhere in
		// one that does not parse.
		return brokerURL{}, usageError("-broker: %s; want %s", why, brokerSchemes)
	}
	if raw == "" {
		return bad("")
	}
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return bad("no scheme")
	}
	b := brokerURL{url: raw}
	switch strings.ToLower(scheme) {
	case "nats", "tls":
		b.kind = "nats"
	case "amqp", "amqps":
		b.kind = "amqp"
	case "kafka":
		// Several hosts, which net/url does not take: each host:port.
		b.kind = "kafka"
		for _, h := range strings.Split(strings.TrimSuffix(rest, "/"), ",") {
			if _, port, err := net.SplitHostPort(h); err != nil || port == "" {
				return bad("each of its brokers must be host:port")
			}
			b.seeds = append(b.seeds, h)
		}
		return b, nil
	default:
		return bad(fmt.Sprintf("unknown scheme %q", scheme))
	}
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return bad("not a URL with a host")
	}
	b.password, _ = u.User.Password()
	return b, nil
}

// dialled is the Relay's Publisher, the broker's once it is dialled: the
// Relay is built, and so its flags checked, before anything is dialled,
// and it publishes only once Run starts, after the dial.
type dialled struct{ outbox.Publisher }

func (f *relayFlags) run(ctx context.Context, e *env) (any, error) {
	b, err := parseBroker(f.broker)
	if err != nil {
		return nil, err
	}
	if f.exchange != "" && b.kind != "amqp" {
		return nil, usageError("-exchange is for an amqp:// broker")
	}
	ring, err := keyRing(f.sealKey, f.previousKeys, f.acceptUnsealed)
	if err != nil {
		return nil, err
	}
	log := e.logger
	var pub dialled
	build := func(st *postgres.Store) (*outbox.Relay, error) {
		ob, err := outbox.New(st, outbox.WithSealer(ring))
		if err != nil {
			return nil, err
		}
		return ob.Relay(&pub, outbox.WithBatch(f.batch), outbox.WithLease(f.lease), outbox.WithRate(f.rate),
			outbox.WithRetention(f.retention), outbox.WithLogger(log))
	}
	// The flags are checked first, on the store that touches nothing yet.
	if _, err := build(e.store); err != nil {
		return nil, usageError("%s", strings.TrimPrefix(err.Error(), "idemkey outbox: "))
	}

	// Then, each within -timeout: the store's table and its outbox
	// (migration 004), then the broker.
	sctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	if err := e.checkTable(sctx); err != nil {
		return nil, err
	}
	// postgres.New's schema check names a missing migration, 004's outbox
	// among them.
	st, err := postgres.New(e.pool, postgres.WithTable(e.table), postgres.WithLogger(log))
	if err != nil {
		var connectErr *pgconn.ConnectError
		if errors.As(err, &connectErr) {
			return nil, err
		}
		return nil, &cmdError{code: exitDatabase, kind: "database", message: strings.TrimPrefix(err.Error(), "idemkey postgres: ")}
	}
	relay, err := build(st)
	if err != nil {
		return nil, err
	}
	lost := make(chan error, 1) // the broker's connection, lost for good
	closeBroker, err := f.dial(sctx, b, &pub, lost)
	if err != nil {
		return nil, &cmdError{code: exitBroker, kind: "broker", message: scrubbed(fmt.Sprintf("cannot connect to the broker at %s: %v", redactedURL(b.url), err), b.password)}
	}
	defer closeBroker()
	cancel()

	log.LogAttrs(ctx, slog.LevelInfo, "idemkey relay: started", slog.String("table", e.table), slog.String("broker", b.kind),
		slog.String("address", redactedURL(b.url)), slog.Int("batch", f.batch), slog.Float64("rate", f.rate))
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan struct{})
	go func() {
		defer close(done)
		relay.Run(rctx) // returns once rctx ends
	}()
	select {
	case <-ctx.Done():
		<-done
		log.LogAttrs(context.WithoutCancel(ctx), slog.LevelInfo, "idemkey relay: stopped", slog.String("table", e.table), slog.String("broker", b.kind))
		return &relayed{Table: e.table, Broker: b.kind, Stopped: true}, nil
	case err := <-lost:
		stop()
		<-done
		return nil, &cmdError{code: exitBroker, kind: "broker", message: scrubbed(fmt.Sprintf("lost the connection to the broker at %s, for good: %v", redactedURL(b.url), err), b.password)}
	}
}

// dial connects to the broker and sets pub's Publisher on it. It returns
// what closes the connection; lost is told if the connection closes for
// good while the relay runs.
func (f *relayFlags) dial(ctx context.Context, b brokerURL, pub *dialled, lost chan<- error) (func(), error) {
	switch b.kind {
	case "nats":
		// It reconnects as long as it takes: the relay retries meanwhile.
		nc, err := nats.Connect(b.url, nats.Name("idemkey relay"), nats.Timeout(time.Until(deadlineOf(ctx))), nats.MaxReconnects(-1))
		if err != nil {
			return nil, err
		}
		// A PubAck not in within half the lease, the time a publish is
		// given, is a failed send.
		js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(f.lease/2))
		if err == nil {
			pub.Publisher, err = idemnats.NewPublisher(js)
		}
		if err != nil {
			nc.Close()
			return nil, err
		}
		return nc.Close, nil
	case "amqp":
		conn, err := amqp.DialConfig(b.url, amqp.Config{
			Properties: amqp.Table{"connection_name": "idemkey relay"},
			Dial:       amqp.DefaultDial(time.Until(deadlineOf(ctx))),
		})
		if err != nil {
			return nil, err
		}
		p, err := idemamqp.NewPublisher(conn, idemamqp.WithExchange(f.exchange))
		if err != nil {
			conn.Close()
			return nil, err
		}
		pub.Publisher = p
		// The Publisher cannot reopen a closed connection: the command
		// stops, with the broker's exit code, for its supervisor to
		// start it again.
		closed := conn.NotifyClose(make(chan *amqp.Error, 1))
		go func() {
			if err, ok := <-closed; ok && err != nil {
				lost <- err
			}
		}()
		return func() {
			p.Close()
			conn.Close()
		}, nil
	default: // kafka
		// A record's delivery is bounded, as a publish is given half the
		// lease: kgo does not end one in flight at its context's end.
		cl, err := kgo.NewClient(kgo.SeedBrokers(b.seeds...), kgo.ClientID("idemkey-relay"), kgo.RecordDeliveryTimeout(f.lease/2))
		if err != nil {
			return nil, err
		}
		// kgo connects lazily: a broker that does not answer is found now.
		if err := cl.Ping(ctx); err != nil {
			cl.Close()
			return nil, err
		}
		if pub.Publisher, err = idemkafka.NewPublisher(cl); err != nil {
			cl.Close()
			return nil, err
		}
		return cl.Close, nil
	}
}

func deadlineOf(ctx context.Context) time.Time {
	d, _ := ctx.Deadline()
	return d
}

// keyRing reads the key files given, if any: the servers' key ring, or nil.
func keyRing(primary string, previous []string, acceptUnsealed bool) (*seal.KeyRing, error) {
	if primary == "" {
		if len(previous) > 0 || acceptUnsealed {
			return nil, usageError("-seal-previous-key and -seal-accept-unsealed need -seal-key")
		}
		return nil, nil
	}
	keys, err := readKeys(append([]string{primary}, previous...))
	if err != nil {
		return nil, err
	}
	opts := []seal.Option{seal.WithPreviousKeys(keys[1:]...)}
	if acceptUnsealed {
		opts = append(opts, seal.WithUnsealedAccepted())
	}
	r, err := seal.NewKeyRing(keys[0], opts...)
	if err != nil {
		return nil, usageError("%s", strings.TrimPrefix(err.Error(), "idemkey/seal: "))
	}
	return r, nil
}
