package idemgateway

import (
	"context"
	"net/http"
	"net/textproto"
	"strings"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/idemhttp"
)

// Option configures ServeMuxOptions.
type Option func(*options)

type options struct {
	headers runtime.HeaderMatcherFunc
	errors  runtime.ErrorHandlerFunc
}

// WithHeaderMatcher is the application's incoming header matcher, asked
// about every header but idemkey's three (runtime.DefaultHeaderMatcher by
// default); one it sends to idemkey's metadata is forwarded as theirs.
func WithHeaderMatcher(m runtime.HeaderMatcherFunc) Option {
	return func(o *options) {
		if m != nil {
			o.headers = m
		}
	}
}

// WithErrorHandler answers every error but idemkey's refusals
// (runtime.DefaultHTTPErrorHandler by default).
func WithErrorHandler(h runtime.ErrorHandlerFunc) Option {
	return func(o *options) {
		if h != nil {
			o.errors = h
		}
	}
}

// ServeMuxOptions returns the options of a runtime.ServeMux that serves
// idemkey's headers and statuses.
func ServeMuxOptions(opts ...Option) []runtime.ServeMuxOption {
	o := options{headers: runtime.DefaultHeaderMatcher, errors: runtime.DefaultHTTPErrorHandler}
	for _, opt := range opts {
		opt(&o)
	}
	in := incoming{next: o.headers}
	return []runtime.ServeMuxOption{
		runtime.WithIncomingHeaderMatcher(in.matchHeader),
		runtime.WithMetadata(in.annotate),
		runtime.WithForwardResponseOption(forwardResponse),
		runtime.WithErrorHandler(handleError(o.errors)),
	}
}

// incoming forwards idemkey's headers by annotate, every other by next: the
// mux drops a value gRPC metadata cannot carry, which would run unprotected.
type incoming struct{ next runtime.HeaderMatcherFunc }

// route is where a header's metadata goes.
func (in incoming) route(name string) (string, bool) {
	switch {
	case strings.EqualFold(name, idemkey.KeyHeader):
		return idemkey.KeyMetadata, true
	case strings.EqualFold(name, idemkey.FirstSentHeader):
		return idemkey.FirstSentMetadata, true
	case strings.EqualFold(name, idemkey.FirstRegionHeader):
		return idemkey.FirstRegionMetadata, true
	}
	return in.next(name)
}

// ours returns which of idemkey's metadata md names: keys are case-insensitive.
func ours(md string) (string, bool) {
	switch {
	case strings.EqualFold(md, idemkey.KeyMetadata):
		return idemkey.KeyMetadata, true
	case strings.EqualFold(md, idemkey.FirstSentMetadata):
		return idemkey.FirstSentMetadata, true
	case strings.EqualFold(md, idemkey.FirstRegionMetadata):
		return idemkey.FirstRegionMetadata, true
	}
	return "", false
}

// matchHeader is route but for the headers that go to idemkey's metadata,
// which annotate forwards, including any next sends there.
func (in incoming) matchHeader(name string) (string, bool) {
	md, ok := in.route(name)
	if !ok {
		return "", false
	}
	if _, mine := ours(md); mine {
		return "", false
	}
	return md, true
}

// annotate forwards each value of every header route sends to idemkey's
// metadata, by forwardable, so that the interceptor reads the key idemhttp
// would, or refuses it the same way (a value sent twice is still twice).
func (in incoming) annotate(_ context.Context, r *http.Request) metadata.MD {
	var md metadata.MD
	for name, values := range r.Header {
		to, ok := in.route(textproto.CanonicalMIMEHeaderKey(name)) // as the mux asks its matcher
		if !ok {
			continue
		}
		if to, ok = ours(to); !ok {
			continue
		}
		if md == nil {
			md = make(metadata.MD, 2)
		}
		for _, v := range values {
			md[to] = append(md[to], forwardable(v))
		}
	}
	return md
}

// forwardable is v, or v trimmed of spaces and tabs (as every reader trims
// it), if gRPC metadata carries it; else unforwardable, refused as malformed.
func forwardable(v string) string {
	if carried(v) {
		return v
	}
	if t := strings.Trim(v, " \t"); carried(t) {
		return t
	}
	return unforwardable
}

// unforwardable is neither a key nor an HTTP date, and never quotes v.
const unforwardable = "not forwardable"

// carried reports whether every byte of v is printable ASCII, 0x20 to 0x7E.
func carried(v string) bool {
	for i := 0; i < len(v); i++ {
		if v[i] < 0x20 || v[i] > 0x7e {
			return false
		}
	}
	return true
}

func forwardResponse(ctx context.Context, w http.ResponseWriter, _ proto.Message) error {
	setReplyHeaders(ctx, w.Header())
	return nil
}

// setReplyHeaders copies the key's fate (the replay marker, or the status
// ignored) and expiry, sent as trailers (or headers), to h.
func setReplyHeaders(ctx context.Context, h http.Header) {
	md, ok := runtime.ServerMetadataFromContext(ctx)
	if !ok {
		return
	}
	switch v := values(md, idemkey.ReplayedMetadata); {
	case idemkey.ParseReplayed(v):
		h.Set(idemkey.ReplayedHeader, "true")
	case idemkey.ParseExecuted(v):
		h.Set(idemkey.ReplayedHeader, "false")
	}
	if idemkey.ParseIgnored(values(md, idemkey.StatusMetadata)) {
		h.Set(idemkey.StatusHeader, idemkey.StatusIgnored)
	}
	if expires, ok := idemkey.ParseExpires(values(md, idemkey.ExpiresMetadata)); ok {
		h.Set(idemkey.ExpiresHeader, idemkey.FormatDate(expires))
	}
}

func values(md runtime.ServerMetadata, key string) []string {
	if v := md.TrailerMD.Get(key); len(v) > 0 {
		return v
	}
	return md.HeaderMD.Get(key)
}

// handleError answers idemkey's refusals as the draft's problems, and every
// other error with next, each with the reply headers set.
func handleError(next runtime.ErrorHandlerFunc) runtime.ErrorHandlerFunc {
	return func(ctx context.Context, mux *runtime.ServeMux, m runtime.Marshaler, w http.ResponseWriter, r *http.Request, err error) {
		setReplyHeaders(ctx, w.Header())
		reason := idemkey.Reason(err)
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
		switch reason {
		case idemkey.ReasonKeyMissing:
			detail = "this operation requires an Idempotency-Key header"
		case idemkey.ReasonKeyInvalid:
			// The interceptor's words are gRPC's; idemhttp's are the client's.
			if _, _, err := idemhttp.KeyFromHeader(r.Header); err != nil {
				detail = err.Error() // never quotes the key
			}
		}
		retryAfter, _ := idemkey.RetryDelay(err)
		idemhttp.WriteProblem(w, code, reason, detail, retryAfter)
	}
}

// reasonStatus is the status idemhttp answers each reason with.
var reasonStatus = map[string]int{
	idemkey.ReasonKeyMissing:       http.StatusBadRequest,
	idemkey.ReasonKeyInvalid:       http.StatusBadRequest,
	idemkey.ReasonFirstSentInvalid: http.StatusBadRequest,
	idemkey.ReasonKeyReused:        http.StatusUnprocessableEntity,
	idemkey.ReasonInProgress:       http.StatusConflict,
	idemkey.ReasonKeyExpired:       http.StatusPreconditionFailed,
	idemkey.ReasonStoreUnavailable: http.StatusServiceUnavailable,
	idemkey.ReasonStoreFull:        http.StatusServiceUnavailable,
	idemkey.ReasonOutcomeUnknown:   http.StatusInternalServerError,
}
