// Package example is a payments service protected by idemkey, the server and
// client commands beside it, and the service config whose retry policy lets a
// duplicate converge on the first reply.
//
// It shows both layers of defence against a double charge: the idempotency
// key (a retry gets the recorded reply), and a business-level unique
// merchant_reference per tenant, which still holds after a key has expired.
// The charges live in a Ledger: in memory beside the memory store, or in
// PostgreSQL beside the Postgres store, where a unique constraint enforces the
// merchant_reference.
package example

import (
	"cmp"
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"maps"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/protokey/rpckit"
	"github.com/idemkey/idemkey/store"
)

// ServiceConfig is the client's gRPC service config: CreateCharge is retried
// on UNAVAILABLE and ABORTED, 5 attempts with exponential backoff. An
// in-progress duplicate is Aborted with server pushback, so it converges on
// the first call's reply.
//
//go:embed service_config.json
var ServiceConfig string

// DeclinedCustomer is the customer whose card is always declined.
const DeclinedCustomer = "cus_declined"

// NewEngine returns the payment service's engine on st, to hand to every
// entry point of one server process (NewServer, NewHTTPHandler), so that
// they share its settings and a key first used over one replays over the
// others: keys scoped to the tenant Authenticate found (Tenant) and required
// on every call. opts add the process's own settings (retention, sealing,
// logging, metrics); its error names the fix for a mistake in them.
func NewEngine(st store.Store, opts ...engine.Option) (*engine.Engine, error) {
	return engine.New(st, append([]engine.Option{engine.WithTenant(Tenant), engine.WithKeyRequired()}, opts...)...)
}

// Config is how NewServer, NewHTTPHandler and NewServiceFromConfig build
// the service. The settings every entry point shares are the engine's
// (NewEngine).
type Config struct {
	// HandlerDelay holds CreateCharge, so a duplicate can arrive while the
	// first call is in progress: with a processor, after its answer and
	// before the charge's write, so that a crash can fall between them;
	// without one, after the write.
	HandlerDelay time.Duration
	// ProcessorURL is the card processor's (a Processor's) base URL, which
	// CreateCharge charges as a recorded step before it writes the charge;
	// empty charges no processor.
	ProcessorURL string
	// ProcessorTimeout bounds each call to the processor; 0 is 5s.
	ProcessorTimeout time.Duration
	// WithoutReconcile gives the processor's step no reconcile function: a
	// step an earlier run left started is answered outcome unknown rather
	// than looked up at the processor.
	WithoutReconcile bool
	// FailAfterCharge fails the first FailAfterCharge calls of CreateCharge
	// with Unavailable after the processor's charge and before the write: a
	// transient failure, which a retry recovers from.
	FailAfterCharge int
	// FailAfterWrite fails the first FailAfterWrite calls of CreateCharge
	// with Unavailable after the charge's write: in atomic mode the charge
	// and its message (PostgresLedger.Announce) roll back with the call,
	// and a retry runs again.
	FailAfterWrite int
	// Options are added to the gRPC interceptor's.
	Options []interceptor.Option
	// Covered names methods ("/package.Service/Method") covered whatever
	// their idempotency_level says, on every entry point: GetCharge, which
	// is NO_SIDE_EFFECTS, is covered only if named here, and its calls then
	// need a key, as every covered call does (NewEngine).
	Covered []string
	// Retention keeps the records of the given covered methods for their
	// own time, in place of the engine's (engine.WithRetention), on every
	// entry point: gRPC (interceptor.WithMethodRetention), Connect
	// (idemconnect.WithProcedureRetention) and the gateway, which calls the
	// gRPC service. The expiry told, the refusal of a stale retry and the
	// sweep follow it. Each must be at least the engine's longest lease
	// (engine.WithMaxLease): NewServer refuses a shorter one.
	Retention map[string]time.Duration
	// ServerOptions are added to the gRPC server's, after its interceptors:
	// a stats handler, for instance.
	ServerOptions []grpc.ServerOption
	// Ledger keeps the charges; nil keeps them in memory.
	Ledger Ledger
	// Atomic runs CreateCharge in idemkey's atomic mode: the charge and the
	// recorded reply commit in one transaction. The engine's store must
	// implement store.Atomic and the ledger must be a PostgresLedger on its
	// database.
	Atomic bool
	// WithoutIdempotency leaves the idemkey interceptor out: the same
	// service with no idempotency at all, the baseline that make load
	// measures idemkey against. The engine is then unused and may be nil.
	WithoutIdempotency bool
	// InTransaction, with WithoutIdempotency, runs each call in a
	// transaction of its own on the ledger's database
	// (PostgresLedger.InTransaction): the baseline of atomic mode, whose
	// round trips and single commit it shares. The ledger must be a
	// PostgresLedger.
	InTransaction bool
}

// NewServer returns a gRPC server with the payment service behind the
// idemkey interceptor on eng (NewEngine), idemkey.v1.KeyService on the same
// engine and options (a client asks what became of a key it sent, GetKey,
// with retention and coverage as the calls have them), plus the health and
// reflection services. Calls to the payment service and to the KeyService
// must authenticate: see Authenticate. Its error is a mistake in
// cfg.Options, atomic mode on a store without it, InTransaction without
// WithoutIdempotency and a PostgresLedger, or a cfg.Covered or
// cfg.Retention the interceptor refuses: a method the protobuf registry
// does not know, a retention for a method not covered, or one shorter than
// the engine's longest lease.
func NewServer(eng *engine.Engine, cfg Config) (*grpc.Server, *health.Server, error) {
	opts := []interceptor.Option{interceptor.WithKeyField("request_id")} // AIP-155
	opts = append(opts, cfg.Options...)
	if len(cfg.Covered) > 0 {
		opts = append(opts, interceptor.WithIncludedMethods(cfg.Covered...))
	}
	for _, method := range slices.Sorted(maps.Keys(cfg.Retention)) {
		opts = append(opts, interceptor.WithMethodRetention(cfg.Retention[method], method))
	}
	if cfg.Atomic {
		opts = append(opts, interceptor.WithAtomicMethods(paymentsv1.PaymentService_CreateCharge_FullMethodName))
	}
	chain := []grpc.UnaryServerInterceptor{Authenticate}
	if !cfg.WithoutIdempotency {
		idem, err := interceptor.UnaryServerInterceptor(eng, opts...)
		if err != nil {
			return nil, nil, err
		}
		chain = append(chain, idem)
	}
	if cfg.InTransaction {
		ledger, ok := cfg.Ledger.(*PostgresLedger)
		if !ok || !cfg.WithoutIdempotency {
			return nil, nil, errors.New("example: InTransaction needs WithoutIdempotency and a PostgresLedger")
		}
		chain = append(chain, ledger.InTransaction())
	}
	srv := grpc.NewServer(append([]grpc.ServerOption{grpc.ChainUnaryInterceptor(chain...)}, cfg.ServerOptions...)...)
	if cfg.Ledger == nil {
		cfg.Ledger = NewMemoryLedger()
	}
	svc, err := NewServiceFromConfig(cfg)
	if err != nil {
		return nil, nil, err
	}
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	if !cfg.WithoutIdempotency {
		// The interceptor's options, so that GetKey covers and keeps a key
		// as the calls do.
		if err := interceptor.RegisterKeyService(srv, eng, opts...); err != nil {
			return nil, nil, err
		}
	}
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	reflection.Register(srv)
	return srv, hs, nil
}

// apiKeys maps bearer tokens to tenants.
var apiKeys = map[string]string{
	"sk_test_acme":   "acme",
	"sk_test_globex": "globex",
}

type tenantKey struct{}

// Authenticate is a unary server interceptor for the payment service and
// idemkey.v1.KeyService: the metadata "authorization: Bearer <api key>"
// names the tenant, and any other call gets Unauthenticated before the
// idempotency interceptor runs. Other services (health) pass through.
func Authenticate(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if !strings.HasPrefix(info.FullMethod, "/"+paymentsv1.PaymentService_ServiceDesc.ServiceName+"/") && info.FullMethod != rpckit.GetKeyProcedure {
		return handler(ctx, req)
	}
	md, _ := metadata.FromIncomingContext(ctx)
	tenant, err := tenantOfBearer(md.Get("authorization"))
	if err != nil {
		return nil, status.Error(codes.Unauthenticated, err.Error())
	}
	return handler(ContextWithTenant(ctx, tenant), req)
}

// ContextWithTenant returns ctx for a call of tenant's, as Authenticate
// makes it: for callers that authenticate otherwise, such as the consumer
// of charge requests.
func ContextWithTenant(ctx context.Context, tenant string) context.Context {
	return context.WithValue(ctx, tenantKey{}, tenant)
}

// Tenant returns the tenant Authenticate found; it is the engine's
// TenantFunc (NewEngine).
func Tenant(ctx context.Context) (string, error) {
	tenant, ok := ctx.Value(tenantKey{}).(string)
	if !ok {
		return "", status.Error(codes.Unauthenticated, "not authenticated")
	}
	return tenant, nil
}

// Service implements PaymentService on a Ledger.
type Service struct {
	paymentsv1.UnimplementedPaymentServiceServer
	ledger Ledger
	delay  time.Duration

	processor  *processorClient // nil: no processor is charged
	reconcile  bool
	failures   atomic.Int64 // the calls still to fail after the processor's charge
	writeFails atomic.Int64 // the calls still to fail after the charge's write
}

// NewService returns a service on ledger that charges no processor, whose
// CreateCharge waits delay after writing each charge.
func NewService(ledger Ledger, delay time.Duration) *Service {
	return &Service{ledger: ledger, delay: delay}
}

// NewServiceFromConfig returns the service of cfg, on its ledger (nil:
// in memory): the one NewServer and NewHTTPHandler serve, for callers that
// serve it otherwise, such as the consumer of charge requests. Only the
// service's settings of cfg count (HandlerDelay, the processor's, and
// FailAfterCharge); its error is a ProcessorURL that is not an http(s) URL.
func NewServiceFromConfig(cfg Config) (*Service, error) {
	if cfg.Ledger == nil {
		cfg.Ledger = NewMemoryLedger()
	}
	s := NewService(cfg.Ledger, cfg.HandlerDelay)
	s.writeFails.Store(int64(cfg.FailAfterWrite))
	if cfg.ProcessorURL == "" {
		return s, nil
	}
	var err error
	if s.processor, err = newProcessorClient(cfg.ProcessorURL, cmp.Or(cfg.ProcessorTimeout, 5*time.Second)); err != nil {
		return nil, err
	}
	s.reconcile = !cfg.WithoutReconcile
	s.failures.Store(int64(cfg.FailAfterCharge))
	return s, nil
}

// chargeStep is the name of CreateCharge's step, the processor's charge.
const chargeStep = "charge-card"

var currencyCode = regexp.MustCompile(`^[A-Z]{3}$`)

// CreateCharge charges a customer: at the card processor, if the service
// has one, as a recorded step, then in the ledger. Invalid requests get
// InvalidArgument (the idemkey interceptor releases the key, so a corrected
// retry may reuse it); a declined card gets FailedPrecondition and a
// merchant_reference used before gets AlreadyExists (both recorded and
// replayed; the reference is found at the write, after the processor's
// charge, where a real service would look it up first). A processor that
// fails gets Unavailable: the key is released, and the retry gets the
// step's result or looks the charge up (reconcile).
func (s *Service) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	tenant, err := Tenant(ctx)
	if err != nil {
		return nil, err
	}
	switch {
	case req.GetCustomerId() == "":
		return nil, status.Error(codes.InvalidArgument, "customer_id is required")
	case req.GetAmount() <= 0:
		return nil, status.Error(codes.InvalidArgument, "amount must be positive")
	case !currencyCode.MatchString(req.GetCurrency()):
		return nil, status.Error(codes.InvalidArgument, "currency must be three upper-case letters, such as EUR")
	case req.GetCustomerId() == DeclinedCustomer:
		return nil, status.Error(codes.FailedPrecondition, "card declined")
	}
	charge := &paymentsv1.Charge{
		Id:                newChargeID(),
		CustomerId:        req.GetCustomerId(),
		Amount:            req.GetAmount(),
		Currency:          req.GetCurrency(),
		Description:       req.GetDescription(),
		MerchantReference: req.GetMerchantReference(),
		CreateTime:        timestamppb.New(time.Now().Truncate(time.Microsecond)), // as PostgreSQL keeps it
	}
	if s.processor == nil {
		if err := s.insert(ctx, tenant, charge); err != nil {
			return nil, err
		}
		time.Sleep(s.delay) // a call that completes whether or not the client still waits
		return charge, nil
	}
	// The processor's charge leaves this database, so it is a recorded
	// step: a retry of the key, after a crash between the charge and its
	// write, or a released failure, gets the processor's id back rather
	// than charge again.
	var reconcile func(context.Context) (string, bool, error)
	if s.reconcile {
		reconcile = s.processor.reconcile
	}
	id, err := engine.Step(ctx, chargeStep, func(ctx context.Context) (string, error) {
		return s.processor.charge(ctx, charge)
	}, reconcile)
	if err != nil {
		// A step whose outcome is unknown, or a store that failed, is
		// answered as the engine says, whatever this returns.
		return nil, status.Error(codes.Unavailable, "the card processor did not answer; a retry finds the charge if it was made")
	}
	charge.ProcessorChargeId = id
	time.Sleep(s.delay)
	if s.failures.Add(-1) >= 0 {
		return nil, status.Error(codes.Unavailable, "a transient failure after the processor's charge (-fail-after-charge)")
	}
	if err := s.insert(ctx, tenant, charge); err != nil {
		return nil, err
	}
	return charge, nil
}

// insert writes charge to the ledger, then fails as FailAfterWrite says.
func (s *Service) insert(ctx context.Context, tenant string, charge *paymentsv1.Charge) error {
	if err := s.ledger.Insert(ctx, tenant, charge); err != nil {
		return err
	}
	if s.writeFails.Add(-1) >= 0 {
		return status.Error(codes.Unavailable, "a transient failure after the charge's write (-fail-after-write)")
	}
	return nil
}

// GetCharge returns one of the calling tenant's charges.
func (s *Service) GetCharge(ctx context.Context, req *paymentsv1.GetChargeRequest) (*paymentsv1.Charge, error) {
	tenant, err := Tenant(ctx)
	if err != nil {
		return nil, err
	}
	return s.ledger.Get(ctx, tenant, req.GetId())
}

// Page sizes of ListCharges (AIP-158): a page_size of 0 asks for
// defaultPageSize, and one above maxPageSize gets maxPageSize.
const (
	defaultPageSize = 50
	maxPageSize     = 1000
)

// ListCharges returns a page of the calling tenant's charges for a customer,
// oldest first, and the token of the next page if there is one.
func (s *Service) ListCharges(ctx context.Context, req *paymentsv1.ListChargesRequest) (*paymentsv1.ListChargesResponse, error) {
	tenant, err := Tenant(ctx)
	if err != nil {
		return nil, err
	}
	if req.GetPageSize() < 0 {
		return nil, status.Error(codes.InvalidArgument, "page_size must not be negative")
	}
	after, err := decodePageToken(req.GetPageToken(), req.GetCustomerId())
	if err != nil {
		return nil, err
	}
	size := min(cmp.Or(int(req.GetPageSize()), defaultPageSize), maxPageSize)
	charges, next, err := s.ledger.List(ctx, tenant, req.GetCustomerId(), after, size)
	if err != nil {
		return nil, err
	}
	resp := &paymentsv1.ListChargesResponse{Charges: charges}
	if !next.IsZero() {
		resp.NextPageToken = encodePageToken(next, req.GetCustomerId())
	}
	return resp, nil
}

func newChargeID() string {
	var b [12]byte
	rand.Read(b[:])
	return "ch_" + hex.EncodeToString(b[:])
}
