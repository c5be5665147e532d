package idemtest

import (
	"context"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
)

// UnaryClientInterceptor returns a gRPC client interceptor that makes each
// call that carries an idempotency key in its outgoing metadata under the
// Kit's Chaos (see Call). Chain it after the key interceptor, where
// grpc-go's own retries run, so that it sees the key the call sends:
//
//	grpc.WithChainUnaryInterceptor(keys, kit.UnaryClientInterceptor())
//
// A call without a key passes through untouched. The caller gets the
// answer of the call's last attempt, with its header, trailer and peer
// (grpc.Header, grpc.Trailer, grpc.Peer), or, for a reply that
// Chaos.LoseReply lost, Unavailable.
func (k *Kit) UnaryClientInterceptor() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		md, _ := metadata.FromOutgoingContext(ctx)
		values := md.Get(idemkey.KeyMetadata)
		msg, isProto := reply.(proto.Message)
		if len(values) != 1 || !isProto {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		key, err := idemkey.ParseKey(values[0])
		if err != nil { // the server refuses it
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		// Each attempt gets header, trailer and peer of its own, since
		// attempts run at once; the caller's get the answered attempt's.
		own, theirs := splitOptions(opts)
		var (
			mu   sync.Mutex
			sent = make(map[int]*grpcAttempt)
		)
		n, lost := k.Call(ctx, key, func(ctx context.Context, n int) Try {
			a := &grpcAttempt{reply: msg.ProtoReflect().New().Interface()}
			if holds(ctx) {
				ctx = metadata.AppendToOutgoingContext(ctx, holdMetadata, "1")
			}
			a.err = invoker(ctx, method, req, a.reply, cc,
				append(own[:len(own):len(own)], grpc.Header(&a.header), grpc.Trailer(&a.trailer), grpc.Peer(&a.peer))...)
			mu.Lock()
			sent[n] = a
			mu.Unlock()
			return a.read(ctx)
		})
		if lost {
			return status.Error(codes.Unavailable, "idemtest: the reply was lost (Chaos.LoseReply): retry the call with its key")
		}
		mu.Lock()
		a := sent[n]
		mu.Unlock()
		theirs.set(a)
		if a.err == nil {
			proto.Reset(msg)
			proto.Merge(msg, a.reply)
		}
		return a.err
	}
}

// UnaryServerInterceptor returns the Kit's server half for gRPC: chained
// after idemkey's interceptor on the server under test, it holds a first
// attempt that Chaos.Cancel cancels once its handler has returned, until the
// Kit has cancelled it, however fast the handler. In atomic mode it then
// answers the cancellation, which rolls the call's transaction back, as a
// server that dies before its commit: a write through the pool, not
// postgres.TxFromContext, is then made twice, and fails the test.
//
//	grpc.NewServer(grpc.ChainUnaryInterceptor(idem, kit.UnaryServerInterceptor()))
//
// Calls whose key is not the checked call's pass through untouched.
func (k *Kit) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	k.server.on.Store(true)
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		key, ok, err := interceptor.KeyFromIncomingContext(ctx)
		if !ok || err != nil {
			return handler(ctx, req)
		}
		md, _ := metadata.FromIncomingContext(ctx)
		resp, err := handler(ctx, req)
		if k.server.ran(ctx, key, len(md.Get(holdMetadata)) > 0, status.Code(err).String()) {
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		return resp, err
	}
}

// grpcAttempt is one attempt's answer as grpc-go gave it.
type grpcAttempt struct {
	reply           proto.Message
	err             error
	header, trailer metadata.MD
	peer            peer.Peer
}

// ownDeadline reports whether an attempt's DeadlineExceeded (expired) is
// its own deadline's, which the server may report a moment before the
// client's timer fires: an attempt with a deadline then got no answer.
func ownDeadline(ctx context.Context, expired bool) bool {
	_, ok := ctx.Deadline()
	return ok && expired
}

func (a *grpcAttempt) read(ctx context.Context) Try {
	st := status.Convert(a.err)
	out := Try{
		Code:     st.Code().String(),
		Failed:   a.err != nil,
		Reply:    st.Message(),
		Replayed: idemkey.ParseReplayed(a.trailer.Get(idemkey.ReplayedMetadata)),
		NoAnswer: a.err != nil && (ctx.Err() != nil || ownDeadline(ctx, st.Code() == codes.DeadlineExceeded)),
	}
	out.Reason = idemkey.Reason(a.err)
	if a.err == nil {
		out.Reply = prototext.Format(a.reply)
	}
	if out.Reason == idemkey.ReasonInProgress {
		out.InProgress = true
		out.RetryAfter, _ = idemkey.RetryDelay(a.err)
	}
	return out
}

type callerOptions struct {
	header, trailer []*metadata.MD
	peer            []*peer.Peer
}

func splitOptions(opts []grpc.CallOption) (own []grpc.CallOption, theirs callerOptions) {
	for _, o := range opts {
		switch o := o.(type) {
		case grpc.HeaderCallOption:
			theirs.header = append(theirs.header, o.HeaderAddr)
		case grpc.TrailerCallOption:
			theirs.trailer = append(theirs.trailer, o.TrailerAddr)
		case grpc.PeerCallOption:
			theirs.peer = append(theirs.peer, o.PeerAddr)
		default:
			own = append(own, o)
		}
	}
	return own, theirs
}

// set gives the caller's options a's header, trailer and peer.
func (c callerOptions) set(a *grpcAttempt) {
	for _, h := range c.header {
		*h = a.header
	}
	for _, t := range c.trailer {
		*t = a.trailer
	}
	for _, p := range c.peer {
		*p = a.peer
	}
}
