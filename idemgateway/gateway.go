package idemgateway

import (
	"context"
	"net/http"
	"strings"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/interceptor"
)

// Option configures ServeMuxOptions.
type Option func(*options)

type options struct {
	headers runtime.HeaderMatcherFunc
	errors  runtime.ErrorHandlerFunc
}

// WithHeaderMatcher is the application's incoming header matcher, asked
// about every header but idemkey's two. The default is
// runtime.DefaultHeaderMatcher.
func WithHeaderMatcher(m runtime.HeaderMatcherFunc) Option {
	return func(o *options) {
		if m != nil {
			o.headers = m
		}
	}
}

// WithErrorHandler is the application's error handler, which answers every
// error that is not one of idemkey's refusals. The default is
// runtime.DefaultHTTPErrorHandler.
func WithErrorHandler(h runtime.ErrorHandlerFunc) Option {
	return func(o *options) {
		if h != nil {
			o.errors = h
		}
	}
}

// ServeMuxOptions returns the options of a runtime.ServeMux that serves
// idemkey's headers and statuses (see the package doc): an incoming header
// matcher, a forward-response option and an error handler.
func ServeMuxOptions(opts ...Option) []runtime.ServeMuxOption {
	o := options{headers: runtime.DefaultHeaderMatcher, errors: runtime.DefaultHTTPErrorHandler}
	for _, opt := range opts {
		opt(&o)
	}
	return []runtime.ServeMuxOption{
		runtime.WithIncomingHeaderMatcher(matchHeader(o.headers)),
		runtime.WithForwardResponseOption(forwardResponse),
		runtime.WithErrorHandler(handleError(o.errors)),
	}
}

// matchHeader forwards idemkey's request headers as the metadata the
// interceptor reads, and asks next about every other header.
func matchHeader(next runtime.HeaderMatcherFunc) runtime.HeaderMatcherFunc {
	return func(key string) (string, bool) {
		switch {
		case strings.EqualFold(key, idemkey.KeyHeader):
			return idemkey.KeyMetadata, true
		case strings.EqualFold(key, idemkey.FirstSentHeader):
			return idemkey.FirstSentMetadata, true
		}
		return next(key)
	}
}

// forwardResponse tells a reply's replay marker and expiry as headers.
func forwardResponse(ctx context.Context, w http.ResponseWriter, _ proto.Message) error {
	setReplyHeaders(ctx, w.Header())
	return nil
}

// setReplyHeaders copies the interceptor's replay marker and key expiry,
// sent as trailers (or headers), to h.
func setReplyHeaders(ctx context.Context, h http.Header) {
	md, ok := runtime.ServerMetadataFromContext(ctx)
	if !ok {
		return
	}
	if idemkey.ParseReplayed(values(md, idemkey.ReplayedMetadata)) {
		h.Set(idemkey.ReplayedHeader, "true")
	}
	if expires, ok := idemkey.ParseExpires(values(md, idemkey.ExpiresMetadata)); ok {
		h.Set(idemkey.ExpiresHeader, idemkey.FormatDate(expires))
	}
}

// values are key's values in the reply's trailer, or else its header.
func values(md runtime.ServerMetadata, key string) []string {
	if v := md.TrailerMD.Get(key); len(v) > 0 {
		return v
	}
	return md.HeaderMD.Get(key)
}

// handleError answers idemkey's refusals as the draft's problems, and hands
// every other error to next, each with the reply headers set.
func handleError(next runtime.ErrorHandlerFunc) runtime.ErrorHandlerFunc {
	return func(ctx context.Context, mux *runtime.ServeMux, m runtime.Marshaler, w http.ResponseWriter, r *http.Request, err error) {
		setReplyHeaders(ctx, w.Header())
		reason := interceptor.Reason(err)
		code, ok := reasonStatus[reason]
		if !ok {
			next(ctx, mux, m, w, r, err)
			return
		}
		// Set by the mux for a client that accepts trailers, if an error
		// follows a reply it began; a problem has none.
		w.Header().Del("Trailer")
		w.Header().Del("Transfer-Encoding")
		detail := status.Convert(err).Message()
		if reason == idemkey.ReasonKeyMissing {
			detail = "this operation requires an Idempotency-Key header"
		}
		retryAfter, _ := interceptor.RetryDelay(err)
		idemhttp.WriteProblem(w, code, reason, detail, retryAfter)
	}
}

// reasonStatus is the draft's status of each of idemkey's reasons, as
// idemhttp answers them.
var reasonStatus = map[string]int{
	idemkey.ReasonKeyMissing:       http.StatusBadRequest,
	idemkey.ReasonKeyInvalid:       http.StatusBadRequest,
	idemkey.ReasonFirstSentInvalid: http.StatusBadRequest,
	idemkey.ReasonKeyReused:        http.StatusUnprocessableEntity,
	idemkey.ReasonInProgress:       http.StatusConflict,
	idemkey.ReasonKeyExpired:       http.StatusPreconditionFailed,
	idemkey.ReasonStoreUnavailable: http.StatusServiceUnavailable,
	idemkey.ReasonStoreFull:        http.StatusServiceUnavailable,
}
