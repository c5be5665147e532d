# Every Go tool is pinned in tools/go.mod (ghz, which needs an older grpc-go,
# in tools/ghz/go.mod) and run with `go tool`, so a fresh machine with Go needs
# nothing else; make test and make load also use the local PostgreSQL binaries,
# and make test the local redis-server and redis-cli, and the Google Cloud
# SDK's Cloud Spanner emulator (scripts/with-spanner).
GO          ?= go
# The tools module is outside the workspace (go.work), and go tool refuses
# -modfile in workspace mode.
TOOL        := env GOWORK=off $(GO) tool -modfile=$(CURDIR)/tools/go.mod
# The modules of the workspace, each checked on its own (GOWORK=off) as a
# user gets it; scripts/release lists the ones it publishes.
MODULES     := . idemconnect idemgateway idemnats idemamqp idemkafka store/redis store/spanner cmd/idemkey tests example
# Every package of every module of the workspace.
PKGS        := github.com/idemkey/idemkey/...
BENCH_COUNT ?= 10
# A count, not a duration: with a duration, go1.26's fuzz coordinator can fail
# a clean run with "context deadline exceeded" as time runs out
# (go.dev/issue/75804).
FUZZ_EXECS  ?= 30000
SOAK        ?= 10m
FAILOVERS   ?= 10
LOAD_TIME   ?= 10s
CONSUMER_MESSAGES ?= 10000
OUTBOX_CHARGES ?= 1000
LOAD_ROUNDS ?= 5
REGIONS_SEED ?= 1

.PHONY: help generate check-generate lint test bench load soak failover-soak consumer-soak outbox-soak regions demo

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-15s %s\n", $$1, $$2}'

generate: ## regenerate the Go code of the protos with buf
	@echo "generate: buf and the protoc plugins run with go tool; the first run downloads and builds them (tools/go.mod), a few minutes"
	$(TOOL) buf generate

check-generate: generate ## fail if generated code or a go.mod is out of date (each module on its own), or a scratch user module gets more than it imports
	@for m in $(MODULES) tools tools/ghz; do echo "go mod tidy -diff in $$m"; (cd $$m && GOWORK=off $(GO) mod tidy -diff) || exit 1; done
	@git diff --exit-code -- proto example/paymentsv1connect example/paymentsv1gw || (echo "generated code is stale: run make generate and commit" && exit 1)
	@test -z "$$(git status --porcelain -- proto example/paymentsv1connect example/paymentsv1gw)" || (git status --porcelain -- proto example/paymentsv1connect example/paymentsv1gw && echo "make generate made new files: commit them" && exit 1)
	./scripts/check-deps

lint: ## gofmt, go vet, staticcheck, buf lint and buf format, and the API's size (tests/apisize)
	@test -z "$$(gofmt -l .)" || (gofmt -l . && echo "gofmt would change these files" && exit 1)
	$(GO) vet $(PKGS)
	@echo "lint: staticcheck and buf run with go tool; the first run downloads and builds them (tools/go.mod), a few minutes"
	@for m in $(MODULES); do echo "staticcheck in $$m (GOWORK=off)"; (cd $$m && $(TOOL) staticcheck ./...) || exit 1; done
	$(TOOL) buf lint
	$(TOOL) buf format -d --exit-code
	@# The published API's size at issue 46's targets (one seam for brokers):
	@# the published total at most 390, 379 used, with the broker stack
	@# (consumer, idemnats, idemamqp, idemkafka) at 65 of at most 70, and the
	@# names defined in more than one package at 18. A later issue's own
	@# names raise the total by their count, named here: issue 49's fate
	@# markers, 5 (idemkey.StatusMetadata, StatusHeader, StatusIgnored,
	@# ParseExecuted, ParseIgnored), and its retention per operation, 5
	@# (engine.Operation.Retention, interceptor.WithMethodRetention,
	@# idemconnect.WithProcedureRetention, and WithRetention in idemhttp and
	@# consumer, which makes WithRetention a 19th shared name); issue 47's
	@# recorded steps, 30: idemkey.ReasonOutcomeUnknown; engine.Step, NotDone,
	@# ForgetSteps, ErrOutcomeUnknown, OutcomeUnknown; store.Stepper, Renewer,
	@# StepKey, StepStart, StepEntry, StepState and its three values; the four
	@# methods of Stepper and Renewer on each of store/memory, store/postgres
	@# and store/redis; postgres.StepRecord, Store.Steps, Store.ResolveStep;
	@# issue 49's key state by key, 17: engine.Engine.Lookup, KeyState, its MadeFor,
	@# KeyStatus and its String and four values; store.Looker and Lookup on
	@# each of store/memory, store/postgres and store/redis;
	@# interceptor.RegisterKeyService, WithLookupFirst;
	@# idemconnect.NewKeyServiceHandler; idemhttp.KeyHandler; issue 48's
	@# outbox, 41: outbox's 19 (Message, Outbox, New, Option, WithSealer,
	@# WithMaxMessageSize, Publish, Publisher, Relay and RelayOption, the
	@# Relay method, Run, WithBatch, WithLease, WithRate, WithRetention,
	@# WithPollInterval, WithLogger, WithMeterProvider); engine.NextMessageID;
	@# store.Outbox, OutboxMessage; store/postgres's seven methods of
	@# store.Outbox; NewPublisher, Publisher and its Publish in idemnats,
	@# idemamqp and idemkafka, with idemamqp's PublisherOption, WithExchange
	@# and Close. Shared by them: Publisher, NewPublisher, Outbox, WithLease,
	@# WithMeterProvider, WithSealer (the engine's and the relay's settings
	@# of one name mean the same); issue 51's Spanner store, 21:
	@# store/spanner's New, Option, WithTable, WithLogger, WithTimeout,
	@# Store, DefaultTable, Migrate, Migrations, TxFromContext, and Store's
	@# Reserve, ReserveBatch, Find, Complete, Release, Lookup, StartStep,
	@# FinishStep, ForgetSteps, Renew and Begin; shared with store/postgres
	@# by them: DefaultTable, Migrate, Migrations, TxFromContext, WithTable
	@# (each means the same on both stores); issue 51's PostgreSQL sharded
	@# by tenant, 25: store.ContextWithPartition, PartitionFromContext; store/pgshard's
	@# New, Option, WithTenants, WithMoving, ErrMoving, Store and its Shards,
	@# ShardOf, Listen, and its 14 methods of store's interfaces (Reserve,
	@# Complete, Release, Find, Lookup, Renew, StartStep, FinishStep,
	@# ForgetSteps, Begin, Sweep, Watch, ReserveBatch, BeginBatch); issue
	@# 49's paced sweep, 1: postgres.WithSweepShare; issue 51's protocol fence
	@# across regions, 8: idemkey.FirstRegionMetadata, FirstRegionHeader,
	@# ValidateRegion, ContextWithKeyFirstRegion, FirstRegionFromContext;
	@# engine.WithRegion, Fenced; interceptor.UseKeyFirstRegion; issue 51's idemkey
	@# -spanner, 10: store/spanner's admin API in store/postgres's shape,
	@# Record, StepRecord, Stats, MigrationState, MigrationStatus,
	@# MigrateDown, and Store's Records, Forget, Steps and Stats; shared
	@# with store/postgres by the first six, which mean the same there,
	@# so -max-shared rises by 6 to 36; store/pgshard's batches failing
	@# only the calls of a moving tenant or a failed shard, 3:
	@# store.PartialError and its Error and Unwrap; its metrics per shard,
	@# 1: pgshard.WithMeterProvider (shared, with the same meaning, by the
	@# engine, outbox and consumers). protokey/rpckit,
	@# the adapters' kit, is counted apart (apisize's kitPackages). The
	@# comment and blank lines of the published packages' non-test,
	@# non-generated files: at most 30% (the package docs are tours, the
	@# manual is docs/).
	$(GO) run ./tests/apisize -root . -max-entry 130 -max-reexport 5 -max-total 546 -max-shared 36 \
		-max-prose-percent 30

# The fuzz targets run first, so that the last line is gotestsum's closing
# "DONE N tests[, M failures] in T" line. gotestsum runs go test and prints a
# line per package as it finishes, then the failures' output.
test: ## run each fuzz target briefly, then every test with the race detector (on PostgreSQL, NATS, RabbitMQ and the Spanner emulator: see scripts/with-postgres, scripts/with-brokers, scripts/with-spanner)
	@echo "test: each fuzz target, $(FUZZ_EXECS) inputs"
	$(GO) test -run='^$$' -fuzz='^FuzzKeyFromMetadata$$' -fuzztime=$(FUZZ_EXECS)x ./interceptor/
	$(GO) test -run='^$$' -fuzz='^FuzzStoredOutcome$$' -fuzztime=$(FUZZ_EXECS)x ./interceptor/
	$(GO) test -run='^$$' -fuzz='^FuzzFingerprint$$' -fuzztime=$(FUZZ_EXECS)x ./protokey/
	$(GO) test -run='^$$' -fuzz='^FuzzKeyHeader$$' -fuzztime=$(FUZZ_EXECS)x ./idemhttp/
	$(GO) test -run='^$$' -fuzz='^FuzzRecord$$' -fuzztime=$(FUZZ_EXECS)x ./idemhttp/
	$(GO) test -run='^$$' -fuzz='^FuzzOpen$$' -fuzztime=$(FUZZ_EXECS)x ./seal/
	$(GO) test -run='^$$' -fuzz='^FuzzDecode$$' -fuzztime=$(FUZZ_EXECS)x ./outbox/
	@echo "test: every package with the race detector; the first run builds the standard library and the dependencies for it, a few minutes before the first package reports"
	./scripts/with-postgres ./scripts/with-brokers ./scripts/with-spanner $(TOOL) gotestsum --format pkgname --format-hide-empty-pkg --raw-command -- \
		env GOWORK=$(CURDIR)/go.work $(GO) test -json -race -count=1 $(PKGS)

bench: ## benchmark the interceptor and the HTTP middleware against the bare call, a duplicate's answer after the record, the Postgres store against hand-written SQL, CreateCharge and the example consumer (NATS, RabbitMQ, Kafka on kfake) in both modes against the bare service, the outbox against a publish to NATS after commit, the sharded PostgreSQL and Spanner (emulator) stores against one PostgreSQL; benchstat summarises
	@mkdir -p bin
	./scripts/with-postgres ./scripts/with-redis $(GO) test -run='^$$' -bench=. -benchmem -count=$(BENCH_COUNT) ./interceptor/ ./idemhttp/ ./engine/ ./protokey/ ./seal/ ./store/postgres/ ./tests/redis/ ./example/ > bin/bench.txt
	./scripts/with-postgres ./scripts/with-brokers $(GO) test -run='^$$' -bench=Consumer -benchtime=1x -count=$(BENCH_COUNT) ./example/consumer/ >> bin/bench.txt
	./scripts/with-postgres ./scripts/with-brokers $(GO) test -run='^$$' -bench='^BenchmarkOutbox$$' -benchmem -count=$(BENCH_COUNT) ./tests/outboxbench/ >> bin/bench.txt
	./scripts/with-postgres ./scripts/with-spanner $(GO) test -run='^$$' -bench='^BenchmarkScaleOut' -benchtime=400x -count=$(BENCH_COUNT) ./tests/storebench/ >> bin/bench.txt
	./scripts/with-postgres $(GO) test -run='^$$' -bench='^BenchmarkAtomicNewKeys$$' -benchtime=100000x -count=1 ./store/postgres/ > bin/newkeys.txt
	@echo "== each call on its own: time and allocations against the bare call"
	@$(TOOL) benchstat -filter '.name:Unary' -col /call bin/bench.txt
	@echo "== the same calls interleaved, so noise hits all alike, over gRPC (bufconn), the gRPC interceptor called directly (no grpc-go) and net/http (in process): time as a ratio to the bare call, and the µs and allocations a first call and a replay add to it"
	@$(TOOL) benchstat -filter '.name:/^(HTTP|Interceptor)?Overhead$$/ .unit:/^(first|replay)(\/bare|-added-µs|-added-allocs)$$/' bin/bench.txt
	@echo "== a duplicate held for a running call: how long after the call's record it has its answer, told by the store (store.Watcher: memory in engine; Redis pub/sub in tests/redis; PostgreSQL LISTEN/NOTIFY in store/postgres, two-phase and atomic, on two replicas; with the reads each duplicate made) and polled, interleaved"
	@$(TOOL) benchstat -filter '.name:DuplicateAnswered' bin/bench.txt
	@echo "== a first call whose handler runs one recorded step (engine.Step) against one that runs none, interleaved, on the memory store: time, and the store writes the step adds (one before it, one after)"
	@$(TOOL) benchstat -filter '.name:Step' bin/bench.txt
	@echo "== the Postgres store against hand-written pgx doing the same design's minimal SQL, interleaved"
	@$(TOOL) benchstat -filter '.name:StoreVsBaseline .unit:/(ns\/op|\/baseline)$$/' bin/bench.txt
	@echo "== Reserve's median latency on tables of 10^4, 10^6 and 10^7 rows, interleaved"
	@$(TOOL) benchstat -filter '.name:ReserveScale .unit:/p50/' bin/bench.txt
	@echo "== the sweeper while live first calls run: rows deleted per second, and the calls' p99 without and during the sweep"
	@$(TOOL) benchstat -filter '.name:SweepUnderLoad .unit:/(rows|p99)/' bin/bench.txt
	@echo "== the interceptor on PostgreSQL over bufconn, with a handler that does nothing, interleaved: each path against the bare call"
	@$(TOOL) benchstat -filter '.name:Interceptor .unit:/(-ns\/op|\/bare)$$/' bin/bench.txt
	@echo "== CreateCharge on PostgreSQL over bufconn, interleaved: atomic and two-phase against the service without idempotency"
	@$(TOOL) benchstat -filter '.name:CreateCharge .unit:/(-ns\/op|\/bare|\/bare-tx)$$/' bin/bench.txt
	@echo "== the example consumer on NATS JetStream, RabbitMQ and Kafka (kfake), interleaved: messages per second, atomic and two-phase, one at a time and in batches of 32, against the consumer without idemkey"
	@$(TOOL) benchstat -filter '.name:/^Consumer/ .unit:/(msgs\/s|\/bare|\/bare-batch)$$/' bin/bench.txt
	@echo "== the outbox: an atomic CreateCharge-like call on PostgreSQL (one INSERT) publishing one message through outbox.Publish in its transaction, against the same call publishing to NATS JetStream after it returned, the same row written by hand (one INSERT, no NOTIFY), and publishing nothing, interleaved"
	@$(TOOL) benchstat -filter '.name:Outbox .unit:/(-ns\/op|\/none|\/insert|\/nats)$$/' bin/bench.txt
	@echo "== the store against each design's hand-written SQL, 16 workers on a pool of 20, interleaved: throughput, PostgreSQL's CPU and WAL per call as ratios"
	@$(TOOL) benchstat -filter '.name:Designs .unit:/(throughput|cpu|wal)$$/' bin/bench.txt
	@echo "== 100,000 atomic calls with new keys on 16 workers, the default slots: how many were not acquired, and how many ran the probe on their own (both must be 0)"
	@grep '^BenchmarkAtomicNewKeys' bin/newkeys.txt
	@echo "== PostgreSQL's own CPU per new key (its backend's, from /proc), interleaved: the store against the design's minimal SQL and the bare INSERT, and each statement's share"
	@$(TOOL) benchstat -filter '.name:/^(BackendCPU|Statements)$$/' bin/bench.txt
	@echo "== the Redis store: WAIT for one replica against none, and against the Postgres store, interleaved"
	@$(TOOL) benchstat -filter '.name:/^(Wait|VsPostgres)$$/ .unit:/(-ns\/op|\/nowait|\/postgres)$$/' bin/bench.txt
	@echo "== the Redis store's first call and replay against a bare go-redis round trip (PING), interleaved: the ratio, and the µs and allocations each adds"
	@$(TOOL) benchstat -filter '.name:Calls .unit:/^(first|replay)(\/ping|-added-µs|-added-allocs)$$/' bin/bench.txt
	@echo "== sealing a 1 KiB reply: Seal and Open alone; the engine's calls, and gRPC calls over bufconn, on the memory store with a key ring against one without, interleaved"
	@$(TOOL) benchstat -filter '.name:Seal .unit:(sec/op OR B/op OR allocs/op)' bin/bench.txt
	@$(TOOL) benchstat -filter '.name:/^Sealed/ .unit:/(-ns\/op|sealed\/plain)$$/' bin/bench.txt
	@echo "== beyond one database, interleaved: store/pgshard on three databases of the same server and store/spanner on the Cloud Spanner emulator (in memory, one transaction at a time: nothing of Spanner's own latency), a first call and a replay on the store and through the gRPC interceptor (bufconn) in both modes, against the same call on one PostgreSQL"
	@$(TOOL) benchstat -filter '.name:/^ScaleOut/ .unit:/(-ns\/op|\/postgres)$$/' bin/bench.txt
	@echo "== every ratio of this run: the median of $(BENCH_COUNT) runs, and their range"
	@$(GO) run ./tests/benchtable bin/bench.txt
	@echo "== charts of this run, for BENCHMARKS.md: docs/bench/reserve-scale.svg, docs/bench/bench-ratios.svg"
	@$(GO) run ./tests/chart -bench bin/bench.txt -out docs/bench

load: ## drive the example server on PostgreSQL with ghz over loopback, bare (autocommitted, and in a transaction: bare-tx) and in both modes, interleaved, beside pgbench running the same SQL as the ceiling (LOAD_TIME per measurement); CPU profiles (one per mode and round) and load.json go to bin/
	@mkdir -p bin
	./scripts/with-postgres $(GO) run ./tests/load -duration=$(LOAD_TIME) -rounds=$(LOAD_ROUNDS) -profile-dir=bin -json=bin/load.json
	@echo "== charts of this run, for BENCHMARKS.md: docs/bench/load-throughput.svg, docs/bench/load-cpu.svg"
	@$(GO) run ./tests/chart -load bin/load.json -out docs/bench

soak: ## inject random faults into example server processes for SOAK (default 10m) per mode, check every reply; the table goes to bin/soak.md
	@mkdir -p bin
	$(GO) test -count=1 -timeout=0 -run='^TestFaults$$' ./tests/reliability/ -soak=$(SOAK) -report=$(CURDIR)/bin/soak.md
	@cat bin/soak.md

failover-soak: ## fail a PostgreSQL primary over to its standby FAILOVERS times (default 10), synchronous and asynchronous, under load; the table goes to bin/failover.md
	@mkdir -p bin
	$(GO) test -count=1 -timeout=0 -run='^TestFailover$$' ./tests/reliability/ -failovers=$(FAILOVERS) -failover-report=$(CURDIR)/bin/failover.md
	@cat bin/failover.md

consumer-soak: ## kill the example consumer three times while it charges CONSUMER_MESSAGES (default 10000) messages from NATS, RabbitMQ and Kafka (kfake; and two consumers join and leave the group) on PostgreSQL, atomic and two-phase, one at a time and in batches of 32; prints the charges, and the double charges of two-phase
	./scripts/with-postgres ./scripts/with-brokers $(GO) test -count=1 -timeout=0 -v -run='^TestKilledMidStream$$' ./example/consumer/ -consumer-messages=$(CONSUMER_MESSAGES) -consumer-modes=atomic,atomic-batch,two-phase,two-phase-batch

outbox-soak: ## make OUTBOX_CHARGES (default 1000) charges through the example server's outbox to NATS, RabbitMQ and Kafka (kfake) while the server, the relay, the consumer of receipts and NATS are killed at random; prints the charges, the receipts and the resends dropped
	./scripts/with-postgres ./scripts/with-brokers $(GO) test -count=1 -timeout=0 -v -run='^TestOutboxKilled$$' ./example/consumer/ -outbox-charges=$(OUTBOX_CHARGES) -outbox-kills=3

regions: ## simulate keys across three regions (pinned, home region, last writer wins, quorum store, the fence) on virtual time: double executions, refusals and availability per design and replication lag, all up and with a region down (REGIONS_SEED, default 1); docs/regions.md reads the table
	$(GO) run ./tests/regions -seed=$(REGIONS_SEED)

# DEMO_ADDR, if set, is the address the demo server must listen on; by
# default it takes a free port.
demo: ## start the example server (PostgreSQL if DATABASE_URL is set, else memory; 1.5s handler delay) on a free port and run the demo client against it
	@mkdir -p bin
	@$(GO) build -o bin/ ./example/server ./example/client
	@./scripts/demo -handler-delay 1.5s
