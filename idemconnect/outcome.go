package idemconnect

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"

	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/protokey"
)

// The record is the gRPC interceptor's, byte for byte in meaning: an
// idemkeyv1.Outcome with the response message's protobuf bytes, or the
// error's code, message and details (google.protobuf.Any), and the replayed
// header and trailer entries under lower-case names. So a record made over
// one transport replays over the other.

// encodeOutcome turns a handler's result into the bytes a store records.
// record is false when the result must be released instead. With redact,
// what is recorded is a copy of the result as redact left it; the caller
// keeps the result itself. An error means nothing can be recorded (the
// caller records an Internal in its place).
func encodeOutcome(ctx context.Context, procedure string, resp connect.AnyResponse, herr error, recorded map[connect.Code]bool, kept *kept, redact RedactFunc) (raw []byte, record bool, err error) {
	if herr != nil {
		if st := statusOf(herr); st.Code == 0 || !recorded[connect.Code(st.Code)] {
			return nil, false, nil
		}
	}
	var msg proto.Message
	if herr == nil {
		m, ok := resp.Any().(proto.Message)
		if !ok || m == nil {
			return nil, false, errors.New("the response is not a protobuf message")
		}
		msg = m
	}
	var out idemkeyv1.Outcome
	if redact != nil {
		reply, err := redacted(ctx, procedure, msg, herr, kept, redact)
		if err != nil {
			return nil, false, err
		}
		msg, herr = reply.Response, reply.Err
		out.Header, out.Trailer = headerEntries(reply.Header), headerEntries(reply.Trailer)
	} else if kept != nil {
		out.Header, out.Trailer = toEntries(kept.header), toEntries(kept.trailer)
	}
	if herr != nil {
		out.Result = &idemkeyv1.Outcome_Status{Status: statusOf(herr)}
		raw, err = proto.Marshal(&out)
		return raw, err == nil, err
	}
	raw, err = protokey.EncodeResponse(msg, &out)
	return raw, err == nil, err
}

// redacted is the Reply that redact leaves of a copy of the handler's
// result. An error means what it left cannot be recorded in the result's
// place: it panicked, turned the handler's error into a response, left
// neither, or replaced the response by one of another type. The handler has
// run, so its key is not released: Internal is recorded instead.
func redacted(ctx context.Context, procedure string, msg proto.Message, herr error, kept *kept, redact RedactFunc) (*Reply, error) {
	reply := &Reply{Err: herr}
	var name protoreflect.FullName
	if msg != nil {
		reply.Response, name = proto.Clone(msg), msg.ProtoReflect().Descriptor().FullName()
	}
	if kept != nil {
		reply.Header, reply.Trailer = toHeader(kept.header), toHeader(kept.trailer)
	}
	if err := runRedaction(ctx, procedure, reply, redact); err != nil {
		return nil, err
	}
	switch resp := reply.Response; {
	case reply.Err != nil:
	case herr != nil:
		return nil, errors.New("the redaction function turned an error into a response")
	case resp == nil:
		return nil, errors.New("the redaction function left neither a response nor an error")
	case resp.ProtoReflect().Descriptor().FullName() != name:
		return nil, fmt.Errorf("the redaction function replaced the %s response by a %s", name, resp.ProtoReflect().Descriptor().FullName())
	}
	return reply, nil
}

// runRedaction calls redact on reply. A panic in it is an error that names
// only the type of the panic's value: a redaction function handles secrets,
// and the value may quote the reply it was removing them from, which the
// error, logged at Error, must not.
func runRedaction(ctx context.Context, procedure string, reply *Reply, redact RedactFunc) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("the redaction function panicked with a value of type %T (the value is not logged: it may quote the reply)", p)
		}
	}()
	redact(ctx, procedure, reply)
	return nil
}

// toHeader is a copy of kept metadata as an http.Header, values of "-bin"
// names decoded.
func toHeader(m map[string][][]byte) http.Header {
	if len(m) == 0 {
		return nil
	}
	h := make(http.Header, len(m))
	for name, vs := range m {
		for _, v := range vs {
			h[canonical(name)] = append(h[canonical(name)], string(v))
		}
	}
	return h
}

// headerEntries is the record of h, under lower-case names.
func headerEntries(h http.Header) []*idemkeyv1.MetadataEntry {
	m := make(map[string][][]byte, len(h))
	for name, vs := range h {
		lower := strings.ToLower(name)
		for _, v := range vs {
			m[lower] = append(m[lower], []byte(v))
		}
	}
	return toEntries(m)
}

// statusOf is the status Connect sends for a handler's error: a
// *connect.Error's own; a context error, even wrapped, is Canceled or
// DeadlineExceeded; any other error is Unknown with its text.
func statusOf(err error) *idemkeyv1.Status {
	var ce *connect.Error
	if errors.As(err, &ce) && ce != nil {
		st := &idemkeyv1.Status{Code: int32(ce.Code()), Message: []byte(ce.Message())}
		for _, d := range ce.Details() {
			st.Details = append(st.Details, &anypb.Any{TypeUrl: typeURLPrefix + d.Type(), Value: d.Bytes()})
		}
		return st
	}
	code := connect.CodeUnknown
	switch {
	case errors.Is(err, context.Canceled):
		code = connect.CodeCanceled
	case errors.Is(err, context.DeadlineExceeded):
		code = connect.CodeDeadlineExceeded
	}
	return &idemkeyv1.Status{Code: int32(code), Message: []byte(err.Error())}
}

// typeURLPrefix is the prefix of the type URL of a detail: Connect names a
// detail by its message's full name alone, gRPC by this URL.
const typeURLPrefix = "type.googleapis.com/"

// unrecordable, tooLarge and noRoom are the outcomes recorded when the
// handler's own cannot be, with the gRPC interceptor's messages: the handler
// ran, so its key must not be released. The caller gets the error too, as
// every retry does.
var (
	unrecordableMsg = "idemkey: the reply of this call could not be recorded"
	unrecordable    = mustEncodeStatus(unrecordableMsg)
	tooLargeMsg     = "idemkey: the reply of this call is too large to record"
	tooLarge        = mustEncodeStatus(tooLargeMsg)
	noRoomMsg       = "idemkey: the reply of this call could not be recorded: the idempotency store is full"
	noRoom          = mustEncodeStatus(noRoomMsg) // within store.SmallOutcome
)

func mustEncodeStatus(msg string) []byte {
	raw, err := proto.Marshal(&idemkeyv1.Outcome{Result: &idemkeyv1.Outcome_Status{
		Status: &idemkeyv1.Status{Code: int32(connect.CodeInternal), Message: []byte(msg)},
	}})
	if err != nil {
		panic(err) // a status without details always marshals
	}
	return raw
}

func internalError(msg string) *connect.Error {
	return connect.NewError(connect.CodeInternal, errors.New(msg))
}

// recorded is an outcome read back from its record.
type recorded struct {
	resp            proto.Message  // the response, when the handler succeeded
	err             *connect.Error // the handler's error, otherwise
	header, trailer []*idemkeyv1.MetadataEntry
}

// decodeOutcome reads a recorded outcome back, its response a message of type
// output. An error means the record cannot be read; a corrupt record never
// panics.
func decodeOutcome(raw []byte, output protoreflect.MessageType) (recorded, error) {
	out, resp, err := protokey.DecodeOutcome(raw, output)
	if err != nil {
		return recorded{}, err
	}
	rec := recorded{resp: resp, header: out.GetHeader(), trailer: out.GetTrailer()}
	if st := out.GetStatus(); resp == nil {
		rec.err = connect.NewError(connect.Code(st.GetCode()), errors.New(string(st.GetMessage())))
		for _, a := range st.GetDetails() {
			d, err := connect.NewErrorDetail(a) // an Any is kept as it is
			if err != nil {
				return recorded{}, err
			}
			rec.err.AddDetail(d)
		}
	}
	return rec, nil
}

// replayedMessage is the response of a replay. A *connect.Response must be
// built for the handler's own response type, which an interceptor cannot
// name, so the replayed message rides in this wrapper: a proto.Message whose
// reflection is the message's own, which Connect's codecs marshal as the
// message itself.
type replayedMessage struct{ proto.Message }

// kept is the allow-listed header and trailer metadata of one call, under
// lower-case names, binary values decoded.
type kept struct {
	allowed         map[string]bool
	header, trailer map[string][][]byte
	before          map[string]int // values already in the CallInfo's header ("h:"+name) or trailer ("t:"+name) before the handler
}

// newKept starts keeping what the handler of a call sets, apart from what
// outer interceptors set in its CallInfo before.
func newKept(allowed map[string]bool, info connect.CallInfo) *kept {
	k := &kept{allowed: allowed}
	if info != nil {
		k.before = map[string]int{}
		for name, vs := range info.ResponseHeader() {
			k.before["h:"+strings.ToLower(name)] += len(vs)
		}
		for name, vs := range info.ResponseTrailer() {
			k.before["t:"+strings.ToLower(name)] += len(vs)
		}
	}
	return k
}

// add keeps the allow-listed part of h, skipping for each name the first
// skip[prefix+name] values.
func (k *kept) add(dst *map[string][][]byte, h http.Header, prefix string) {
	for name, vs := range h {
		lower := strings.ToLower(name)
		if !k.allowed[lower] {
			continue
		}
		if prefix != "" {
			vs = vs[min(k.before[prefix+lower], len(vs)):]
		}
		for _, v := range vs {
			if *dst == nil {
				*dst = map[string][][]byte{}
			}
			(*dst)[lower] = append((*dst)[lower], decodeValue(lower, v))
		}
	}
}

func decodeValue(name, v string) []byte {
	if strings.HasSuffix(name, "-bin") {
		if b, err := connect.DecodeBinaryHeader(v); err == nil {
			return b
		}
	}
	return []byte(v)
}

func toEntries(m map[string][][]byte) []*idemkeyv1.MetadataEntry {
	entries := make([]*idemkeyv1.MetadataEntry, 0, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		entries = append(entries, &idemkeyv1.MetadataEntry{Key: k, Values: m[k]})
	}
	return entries
}

// addEntries adds the entries whose names are allowed to h.
func addEntries(h http.Header, entries []*idemkeyv1.MetadataEntry, allowed map[string]bool) {
	for _, e := range entries {
		name := e.GetKey()
		if !allowed[name] {
			continue
		}
		key := canonical(name)
		for _, v := range e.GetValues() {
			if strings.HasSuffix(name, "-bin") {
				h[key] = append(h[key], connect.EncodeBinaryHeader(v))
			} else {
				h[key] = append(h[key], string(v))
			}
		}
	}
}
