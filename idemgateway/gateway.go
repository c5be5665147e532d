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
// about every header but idemkey's two. A header it sends to idemkey's
// metadata is forwarded as idemkey's headers are (see the package doc).
// The default is runtime.DefaultHeaderMatcher.
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
// matcher, a metadata annotator, a forward-response option and an error
// handler.
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

// incoming forwards a request's headers to the call's metadata: idemkey's
// own by annotate, every other by the mux's header matcher, which asks next.
//
// The mux forwards a header's value only if gRPC metadata can carry it as
// it is (0x20 to 0x7E), and drops any other with a log line; a key dropped
// so would run the call unprotected. So idemkey's headers are not left to
// the mux: annotate forwards each of their values, as sent if it can be.
type incoming struct{ next runtime.HeaderMatcherFunc }

// route is the metadata a header goes to: idemkey's headers to the metadata
// the interceptor reads, and every other where next says.
func (in incoming) route(name string) (string, bool) {
	switch {
	case strings.EqualFold(name, idemkey.KeyHeader):
		return idemkey.KeyMetadata, true
	case strings.EqualFold(name, idemkey.FirstSentHeader):
		return idemkey.FirstSentMetadata, true
	}
	return in.next(name)
}

// ours returns which of idemkey's metadata md names, if it names one:
// metadata keys are not case-sensitive.
func ours(md string) (string, bool) {
	switch {
	case strings.EqualFold(md, idemkey.KeyMetadata):
		return idemkey.KeyMetadata, true
	case strings.EqualFold(md, idemkey.FirstSentMetadata):
		return idemkey.FirstSentMetadata, true
	}
	return "", false
}

// matchHeader is the mux's incoming header matcher: route, but for the
// headers that go to idemkey's metadata, which annotate forwards. These
// include any that next sends there too (such as
// Grpc-Metadata-Idempotency-Key, with runtime.LegacyHeaderMatcher).
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

// annotate is the mux's metadata annotator: it forwards the values of
// every header that route sends to idemkey's metadata, each one that gRPC
// metadata can carry as sent, and the others by forwardable, so that the
// interceptor reads the same key as idemhttp would from the same header, or
// refuses it the same way (a value sent twice is still sent twice).
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

// forwardable is v as gRPC metadata can carry it, in bytes 0x20 to 0x7E: v
// itself if it can be; or else v without the spaces and tabs around it,
// which idemkey.ParseKey and the engine's reading of a first-sent time trim
// anyway (so that it names the same key, or time, as v); or else, since a
// byte within v is one that no key and no HTTP date holds, unforwardable,
// which the interceptor refuses as malformed, as it would v.
func forwardable(v string) string {
	if carried(v) {
		return v
	}
	if t := strings.Trim(v, " \t"); carried(t) {
		return t
	}
	return unforwardable
}

// unforwardable stands for a value that gRPC metadata cannot carry: it is
// neither a key (it holds a space) nor an HTTP date. It never quotes the
// value.
const unforwardable = "not forwardable"

// carried reports whether gRPC metadata carries v as it is: every byte is
// printable ASCII, 0x20 to 0x7E.
func carried(v string) bool {
	for i := 0; i < len(v); i++ {
		if v[i] < 0x20 || v[i] > 0x7e {
			return false
		}
	}
	return true
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
			// The interceptor read the header's values as forwarded, and
			// says what is wrong in gRPC's words; idemhttp's, the same
			// header's, are the client's.
			if _, _, err := idemhttp.KeyFromHeader(r.Header); err != nil {
				detail = err.Error() // never quotes the key
			}
		}
		retryAfter, _ := idemkey.RetryDelay(err)
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
