// Command idemkey inspects and maintains an idemkey store on PostgreSQL or
// Cloud Spanner, and relays a PostgreSQL store's outbox to a broker.
//
//	idemkey inspect -tenant T -method M -key K   show one record and its steps
//	idemkey inspect -hash HEX                    the same, by hash or its logged prefix
//	idemkey forget  (same selectors) [-force]    delete one record: the next call runs again
//	idemkey resolve-step (same selectors) -step NAME -done RESULT_JSON | -not-done
//	                                             tell a started step's outcome
//	idemkey stats                                rows by state, expired rows, sizes
//	idemkey sweep [-batch N] [-share F]          delete the expired records and steps now
//	idemkey migrate up|down|status [-to N] [-force]
//	idemkey relay -broker URL [-exchange X]      send the outbox's messages, until SIGINT or SIGTERM
//
// Every command takes -database-url (default $DATABASE_URL) or -spanner
// (below), -table (default idempotency_keys; "schema.name" for another
// schema on PostgreSQL), -timeout (default 30s) and -json, which prints
// one JSON object on stdout instead of text, errors included ({"error":
// kind, "message": ...}), except a command line that does not parse, which
// the flag package reports on stderr.
//
// # Cloud Spanner
//
// -spanner projects/P/instances/I/databases/D, instead of -database-url,
// names a store on Spanner (store/spanner), through the Go client, which
// uses the emulator at SPANNER_EMULATOR_HOST if it is set and Google's
// default credentials otherwise. The database must exist. inspect, forget,
// stats and migrate (up, status, down) work on it as on PostgreSQL, with
// four differences: stats tells no sizes (Spanner shows them in its
// console); migrate status tells no time a migration was applied (Spanner's
// schema keeps none: a migration is applied when its tables exist); migrate
// down is one schema update, which Spanner applies statement by statement,
// not one transaction; and a step keeps no start time. sweep has nothing
// to do there, says so and exits 0: the tables' row deletion policy deletes
// expired rows. resolve-step and relay refuse -spanner (exit 2):
// store/spanner has no operator's write of a step, and the outbox is
// PostgreSQL's.
//
// A store sharded by tenant (store/pgshard) is a store on each shard's
// database: run a command with each shard's -database-url (migrate up on
// every one before the servers start; inspect and forget on the tenant's
// shard, which pgshard.Store.ShardOf names).
//
// # Selecting a record
//
// The store keeps no raw key or tenant, only a SHA-256 of the scope: -tenant,
// -method and -key hash it exactly as the interceptor does. -method is the
// full method name, such as /example.payments.v1.PaymentService/CreateCharge;
// a server whose engine has engine.WithScope(engine.ScopeTenant) leaves the
// method out of the scope, and -method "" does the same. All three flags
// must be given, even when empty, so that a forgotten one is not read as an
// empty one.
//
// -hash selects by the hash instead: all 64 hex digits, or a prefix, such as
// the 12 digits that the interceptor's and the store's log lines show as
// scope=. A prefix that matches several records lists them and selects none.
//
// The raw tenant and key are used only to compute the hash: they are never
// printed or logged.
//
// # Sealed records
//
// A record sealed by a server with a key ring (package seal) is found,
// inspected and forgotten as any other: its hash, state, token, times and
// fingerprint are not sealed. inspect shows the id of the key that sealed
// its outcome and the outcome's size; given the servers' key files with
// -seal-key (and -seal-previous-key, once per key, for records sealed
// before a rotation), it opens the outcome and shows it as for a record
// that is not sealed. The command never writes a record, so it never seals.
//
// # Forgetting
//
// forget deletes one record, so that the next call with the key runs the
// handler again, as if it were new. A record in progress under a live lease
// belongs to a call that may still be running: forget refuses it unless
// -force, and then that call can no longer record its outcome (its lease is
// lost) and its duplicates run again too.
//
// # Steps
//
// inspect also lists the key's recorded steps (engine.Step), which outlive
// its record's release, so a key with steps and no record is shown too:
// each step's name, started (not finished: its outcome is unknown) or done,
// and a done step's result, its size and, when it is printable text of at
// most 4 KiB, the result itself (the JSON of the step's value). A sealed
// result opens with -seal-key, as an outcome does.
//
// A run that finds a step started and not finished never runs it blind: it
// asks the step's reconcile function, or answers "outcome unknown" until an
// operator tells the outcome with resolve-step, having checked the system
// the step calls (the card processor, say). -done RESULT_JSON records that
// the step took effect, with its result as JSON, the way the engine records
// a step's value, sealed with -seal-key if the servers seal (the command
// refuses an unsealed result for a key whose records are sealed); the next
// run uses it and does not run the step. -not-done deletes the step, so
// that the next run runs it. A finished step is left as it is, and a key in
// progress under a live lease is refused: its run may be running the step.
//
// # Sweeping
//
// sweep deletes the expired records and steps of the PostgreSQL tables now,
// as a store.Janitor does every minute. Expired rows already count as
// absent, so sweeping only frees space. A Redis store (store/redis) needs no sweeping:
// the server deletes each record itself when it expires.
//
// # Migrations
//
// migrate up applies the store's migrations (postgres.Migrate); status lists
// them with the time each was applied, from the table <table>_migrations that
// Migrate keeps; down runs the .down.sql files, newest first, in one
// transaction, down to version -to (default: one step). Dropping the table
// drops every recorded reply, so down refuses a table that holds records
// unless -force.
//
// # Relaying the outbox
//
// relay runs an outbox.Relay on the table's outbox (<table>_outbox,
// migration 004), sending the messages that handlers published
// (outbox.Publish) to the broker of -broker:
//
//	nats://host:port                    NATS JetStream: each message's destination is its subject
//	amqp://user:pass@host:port/vhost    RabbitMQ (amqps:// for TLS): its routing key on -exchange
//	                                    (default "": the queue it names)
//	kafka://host:port[,host:port]       Kafka: its topic; its partition key the record's key
//
// with -batch, -rate, -lease and -retention as outbox's WithBatch, WithRate,
// WithLease and WithRetention, and -seal-key (-seal-previous-key,
// -seal-accept-unsealed) if the servers seal the messages
// (outbox.WithSealer). It checks the flags, the table and its outbox, and
// connects to the broker, each within -timeout, then relays until SIGINT
// or SIGTERM, and exits 0. It logs its start and stop, and the relay's
// warnings, on stderr (JSON lines with -json), never the URLs' passwords.
// Several relays may run on one outbox: each claims its messages for
// -lease. A RabbitMQ connection that closes stops it with exit code 5, for
// its supervisor to start it again; NATS and Kafka reconnect.
//
// # Exit codes
//
//	0  done
//	1  no such record (inspect, forget), or step (resolve-step)
//	2  usage: a bad flag, or a hash prefix that matches several records
//	3  refused: forget of a live record, or migrate down of records, without -force;
//	   resolve-step of a finished step, or of a key under a live lease
//	4  database: unreachable, a missing table, or an error it answered
//	5  broker: relay cannot connect to it, or lost its RabbitMQ connection
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/store/postgres"
)

// Exit codes.
const (
	exitOK       = 0
	exitNotFound = 1
	exitUsage    = 2
	exitRefused  = 3
	exitDatabase = 4
	exitBroker   = 5
)

const usage = `usage:
  idemkey inspect -tenant T -method M -key K | -hash HEX  [-seal-key FILE [-seal-previous-key FILE]...]
  idemkey forget  -tenant T -method M -key K | -hash HEX  [-force] [-seal-key FILE ...]
  idemkey resolve-step -tenant T -method M -key K | -hash HEX  -step NAME  -done RESULT_JSON | -not-done  [-seal-key FILE]
  idemkey stats
  idemkey sweep   [-batch N] [-share F]
  idemkey migrate up|down|status  [-to N] [-force]
  idemkey relay   -broker nats://host:port | amqp://user:pass@host:port/vhost | kafka://host:port[,host:port]
                  [-exchange X] [-batch N] [-rate N] [-lease D] [-retention D] [-seal-key FILE ...]
common flags: -database-url URL (default $DATABASE_URL) | -spanner projects/P/instances/I/databases/D,
              -table NAME, -timeout 30s, -json (resolve-step and relay: PostgreSQL only)
run "idemkey COMMAND -h" for a command's flags
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// command is one subcommand: flags registers its own flags, exec runs it
// once the database is open.
type command struct {
	flags func(fs *flag.FlagSet)
	exec  func(ctx context.Context, e *env) (any, error)
	// human prints exec's result as text.
	human func(w io.Writer, result any)
	// serve is for a command that runs until interrupted (relay): -timeout
	// bounds only its start, and it logs to stderr.
	serve bool
	// postgresOnly, if set, is why the command refuses -spanner.
	postgresOnly string
}

// run runs the command line args (without the program name) and returns the
// exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	name, args := args[0], args[1:]
	var (
		cmd    command
		action string // migrate's
	)
	switch name {
	case "inspect":
		cmd = inspectCommand()
	case "forget":
		cmd = forgetCommand()
	case "resolve-step":
		cmd = resolveStepCommand()
	case "stats":
		cmd = statsCommand()
	case "sweep":
		cmd = sweepCommand()
	case "migrate":
		cmd = migrateCommand(&action)
	case "relay":
		cmd = relayCommand()
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage)
		return exitOK
	default:
		fmt.Fprintf(stderr, "idemkey: unknown command %q\n%s", name, usage)
		return exitUsage
	}

	fs := flag.NewFlagSet("idemkey "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var c common
	c.register(fs)
	if cmd.flags != nil {
		cmd.flags(fs)
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	rest := fs.Args()
	if name == "migrate" {
		// The action comes first or after the flags; flags may follow it.
		if len(rest) == 0 {
			fmt.Fprintln(stderr, "idemkey migrate: want an action: up, down or status")
			return exitUsage
		}
		action = rest[0]
		if !slices.Contains([]string{"up", "down", "status"}, action) {
			fmt.Fprintf(stderr, "idemkey migrate: unknown action %q: want up, down or status\n", action)
			return exitUsage
		}
		if err := fs.Parse(rest[1:]); err != nil {
			return exitUsage
		}
		rest = fs.Args()
	}
	if len(rest) > 0 {
		fmt.Fprintf(stderr, "idemkey %s: unexpected argument %q\n", name, rest[0])
		return exitUsage
	}
	visited := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { visited[f.Name] = true })

	conns := int32(2)
	if cmd.serve {
		conns = 4 // the relay's listener holds one for good
	}
	e, err := c.open(ctx, conns, visited, cmd.postgresOnly)
	if err == nil {
		defer e.db.close()
		e.visited, e.timeout, e.logger = visited, c.timeout, logger(stderr, c.json)
		if !cmd.serve {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, c.timeout)
			defer cancel()
		}
		var result any
		result, err = cmd.exec(ctx, e)
		if err == nil {
			if c.json {
				writeJSON(stdout, result)
			} else {
				cmd.human(stdout, result)
			}
			return exitOK
		}
	}
	return fail(err, &c, e, stdout, stderr)
}

// common holds the flags every command takes.
type common struct {
	databaseURL string
	spanner     string // a database's name, projects/P/instances/I/databases/D
	table       string
	timeout     time.Duration
	json        bool
}

func (c *common) register(fs *flag.FlagSet) {
	fs.StringVar(&c.databaseURL, "database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL of the store (default $DATABASE_URL)")
	fs.StringVar(&c.spanner, "spanner", "", "instead of -database-url, the store's Cloud Spanner database: projects/P/instances/I/databases/D (store/spanner; the emulator's if SPANNER_EMULATOR_HOST is set)")
	fs.StringVar(&c.table, "table", postgres.DefaultTable, `the store's table: name, or schema.name (PostgreSQL)`)
	fs.DurationVar(&c.timeout, "timeout", 30*time.Second, "how long the command may take (relay: its start)")
	fs.BoolVar(&c.json, "json", false, "print one JSON object instead of text")
}

// env is what a command works with. The CLI holds no SQL of its own: it
// reads and changes the tables through the store's package (the Records,
// Forget, Steps and Stats of postgres.Store or spanner.Store, and
// postgres.Store's ResolveStep and Sweep) and the migrations through it.
type env struct {
	db       db              // the store's tables, on PostgreSQL or Spanner
	pool     *pgxpool.Pool   // PostgreSQL's, nil on Spanner
	store    *postgres.Store // on the -table, built without its schema check; nil on Spanner
	table    string          // as -table named it
	spanner  string          // as -spanner named it; "" on PostgreSQL
	password string          // of the URL, never printed
	visited  map[string]bool // the flags given on the command line
	timeout  time.Duration   // -timeout
	logger   *slog.Logger    // a serving command's, on stderr
}

// open connects to the database, PostgreSQL's or with -spanner Spanner's,
// for a command that refuses Spanner for the reason postgresOnly, if set; it
// touches nothing yet.
func (c *common) open(ctx context.Context, conns int32, visited map[string]bool, postgresOnly string) (*env, error) {
	if c.spanner != "" || visited["spanner"] {
		switch {
		case visited["database-url"]:
			return nil, usageError("give -spanner or -database-url, not both")
		case postgresOnly != "":
			return nil, usageError("-spanner: %s", postgresOnly)
		}
		return c.openSpanner(ctx)
	}
	if c.databaseURL == "" {
		return nil, usageError("no database: give -database-url, set DATABASE_URL, or give -spanner")
	}
	cfg, err := pgxpool.ParseConfig(c.databaseURL)
	if err != nil {
		// pgx's message does not repeat the URL, but scrub it anyway.
		return nil, usageError("-database-url: %s", scrubbed(err.Error(), ""))
	}
	cfg.MaxConns = conns
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "idemkey"
	}
	e := &env{password: cfg.ConnConfig.Password}
	pool, err := pgxpool.NewWithConfig(ctx, cfg) // connects lazily
	if err != nil {
		return e, err
	}
	e.pool = pool
	// postgres.New checks the table name exactly as the store will; without
	// its schema check, it touches nothing (migrate up makes the table).
	st, err := postgres.New(pool, postgres.WithTable(c.table), postgres.WithoutSchemaCheck())
	if err != nil {
		pool.Close()
		return e, usageError("-table: %s", strings.TrimPrefix(err.Error(), "idemkey postgres: "))
	}
	e.store, e.table = st, c.table
	e.db = pgDB{pool: pool, store: st, table: c.table}
	return e, nil
}

// logger logs to w, as text, or with -json as JSON lines.
func logger(w io.Writer, json bool) *slog.Logger {
	if json {
		return slog.New(slog.NewJSONHandler(w, nil))
	}
	return slog.New(slog.NewTextHandler(w, nil))
}

func writeJSON(w io.Writer, v any) {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// checkTable fails with a clear message when the store's table is missing:
// it reads no record, which fails on a missing table all the same. It is
// also the first round trip, so it finds an unreachable database.
func (e *env) checkTable(ctx context.Context) error {
	_, err := e.db.records(ctx, nil, nil, 0)
	if e.db.missingTable(err) {
		return &cmdError{code: exitDatabase, kind: "database", message: missingTable(e.table, e.spanner)}
	}
	return err
}
