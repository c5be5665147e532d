// Package idemconnecttest is the Connect adapter of package idemtest, the
// kit that proves handlers and clients safe to retry: a client interceptor
// that makes each call under a Kit's Chaos.
//
//	kit := idemtest.New(t, idemtest.Chaos{DropReply: true, Duplicates: 3, Effects: countCharges})
//	client := paymentsv1connect.NewPaymentServiceClient(httpClient, url,
//		connect.WithInterceptors(idemconnect.NewClientInterceptor(), idemconnecttest.Interceptor(kit)))
//
// It is a package of its own, rather than a function of idemconnect or of
// idemtest, for what each imports: idemtest is in the core module, which
// does not require connect-go, and a program that imports idemconnect
// should not link package testing, which a test kit imports.
package idemconnecttest

import (
	"context"
	"errors"
	"reflect"
	"sync"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/idemtest"
)

// Interceptor returns a Connect client interceptor that makes each unary
// call whose request carries an Idempotency-Key header under kit's Chaos
// (see idemtest.Kit.Call), each attempt with a copy of the request. Put it
// after idemconnect.NewClientInterceptor in connect.WithInterceptors, so
// that it sees the key the call sends. A call without a key, a streaming
// call and a handler's call pass through untouched. The caller gets the
// answer of the call's last attempt, or, for a reply that
// idemtest.Chaos.LoseReply lost, Unavailable.
func Interceptor(kit *idemtest.Kit) connect.Interceptor {
	return connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			values := req.Header().Values(idemkey.KeyHeader)
			if !req.Spec().IsClient || len(values) != 1 {
				return next(ctx, req)
			}
			key, err := idemkey.ParseKey(values[0])
			if err != nil { // the server refuses it
				return next(ctx, req)
			}
			var (
				mu   sync.Mutex
				sent = make(map[int]answer)
			)
			n, lost := kit.Call(ctx, key, func(ctx context.Context, n int) idemtest.Try {
				var a answer
				a.resp, a.err = next(ctx, copyRequest(req))
				mu.Lock()
				sent[n] = a
				mu.Unlock()
				return a.read(ctx)
			})
			if lost {
				return nil, connect.NewError(connect.CodeUnavailable, errors.New("idemtest: the reply was lost (Chaos.LoseReply): retry the call with its key"))
			}
			mu.Lock()
			defer mu.Unlock()
			return sent[n].resp, sent[n].err
		}
	})
}

// answer is one attempt's answer as connect-go gave it.
type answer struct {
	resp connect.AnyResponse
	err  error
}

func (a answer) read(ctx context.Context) idemtest.Try {
	if a.err != nil {
		var meta []string
		if ce := new(connect.Error); errors.As(a.err, &ce) {
			meta = ce.Meta().Values(idemkey.ReplayedHeader)
		}
		out := idemtest.Try{
			Code:     connect.CodeOf(a.err).String(),
			Failed:   true,
			Reply:    a.err.Error(),
			Replayed: idemkey.ParseReplayed(meta),
			NoAnswer: ctx.Err() != nil || ownDeadline(ctx, connect.CodeOf(a.err) == connect.CodeDeadlineExceeded),
		}
		out.Reason = idemkey.Reason(a.err)
		if out.Reason == idemkey.ReasonInProgress {
			out.InProgress = true
			out.RetryAfter, _ = idemkey.RetryDelay(a.err)
		}
		return out
	}
	out := idemtest.Try{Code: "ok", Replayed: idemkey.ParseReplayed(a.resp.Header().Values(idemkey.ReplayedHeader))}
	if msg, ok := a.resp.Any().(proto.Message); ok {
		out.Reply = prototext.Format(msg)
	}
	return out
}

// copyRequest is a *connect.Request of req's message, with a copy of its
// header: connect-go writes to a request as it sends it, so attempts sent
// at once each need their own. connect.NewRequest needs the message's
// type at compile time; reflection gives it here.
func copyRequest(req connect.AnyRequest) connect.AnyRequest {
	r := reflect.New(reflect.TypeOf(req).Elem())
	r.Elem().FieldByName("Msg").Set(reflect.ValueOf(req.Any()))
	cp := r.Interface().(connect.AnyRequest)
	for name, values := range req.Header() {
		cp.Header()[name] = append([]string(nil), values...)
	}
	return cp
}

// ownDeadline reports whether an attempt's deadline_exceeded (expired) is
// its own deadline's, which the server may report a moment before the
// client's timer fires: an attempt with a deadline then got no answer.
func ownDeadline(ctx context.Context, expired bool) bool {
	_, ok := ctx.Deadline()
	return ok && expired
}
