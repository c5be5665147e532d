package interceptor

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"sync"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/idemkey/idemkey/internal/redaction"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/protokey"
)

// encodeOutcome turns a handler's result into the bytes a store records.
// record is false when the result must be released instead. With redact,
// what is recorded is a copy of the result as redact left it; the caller
// keeps the result itself. An error means nothing can be recorded (the
// caller records an Internal in its place).
func encodeOutcome(ctx context.Context, method string, resp any, herr error, recorded map[codes.Code]bool, r *recorder, redact RedactFunc) (raw []byte, record bool, err error) {
	if herr != nil {
		if st := statusOf(herr); st.Code() == codes.OK || !recorded[st.Code()] {
			return nil, false, nil
		}
	}
	var out *idemkeyv1.Outcome // the kept metadata; nil, as for most calls, without any
	if redact != nil {
		reply, err := redacted(ctx, method, resp, herr, r, redact)
		if err != nil {
			return nil, false, err
		}
		resp, herr = reply.Response, reply.Err
		out = withMetadata(toEntries(reply.Header), toEntries(reply.Trailer))
	} else if r != nil {
		out = withMetadata(r.entries())
	}
	if herr != nil {
		if out == nil {
			out = &idemkeyv1.Outcome{}
		}
		raw, err = encodeStatus(statusOf(herr), out)
		return raw, err == nil, err
	}
	msg, ok := resp.(proto.Message)
	if !ok || msg == nil {
		return nil, false, errors.New("the response is not a protobuf message")
	}
	raw, err = protokey.EncodeResponse(msg, out)
	return raw, err == nil, err
}

// withMetadata is an Outcome that holds header and trailer; nil if both
// are empty, so that a record without metadata allocates no Outcome.
func withMetadata(header, trailer []*idemkeyv1.MetadataEntry) *idemkeyv1.Outcome {
	if len(header) == 0 && len(trailer) == 0 {
		return nil
	}
	return &idemkeyv1.Outcome{Header: header, Trailer: trailer}
}

// redacted is the Reply that redact leaves of a copy of the handler's
// result. A panic in redact is an error, so that the handler's key is not
// released: the handler has run.
func redacted(ctx context.Context, method string, resp any, herr error, r *recorder, redact RedactFunc) (*Reply, error) {
	reply := &Reply{Err: herr}
	var name protoreflect.FullName
	if herr == nil {
		msg, ok := resp.(proto.Message)
		if !ok || msg == nil {
			return nil, errors.New("the response is not a protobuf message")
		}
		reply.Response, name = proto.Clone(msg), msg.ProtoReflect().Descriptor().FullName()
	}
	if r != nil {
		r.mu.Lock()
		reply.Header, reply.Trailer = r.header.Copy(), r.trailer.Copy()
		r.mu.Unlock()
	}
	if err := redaction.Apply(herr, name, &reply.Err, &reply.Response, func() { redact(ctx, method, reply) }); err != nil {
		return nil, err
	}
	return reply, nil
}

// statusOf is the status gRPC sends for a handler's error: a context error,
// even wrapped, is Canceled or DeadlineExceeded rather than Unknown.
func statusOf(err error) *status.Status {
	if st, ok := status.FromError(err); ok {
		return st
	}
	return status.FromContextError(err)
}

// encodeStatus records st, with the metadata already in out.
func encodeStatus(st *status.Status, out *idemkeyv1.Outcome) ([]byte, error) {
	p := st.Proto()
	out.Result = &idemkeyv1.Outcome_Status{Status: &idemkeyv1.Status{Code: p.Code, Message: []byte(p.Message), Details: p.Details}}
	return proto.Marshal(out)
}

// unrecordable and tooLarge are the outcomes recorded when the handler's own
// cannot be: the handler ran, so its key must not be released. The caller
// gets the error too, as every retry does.
var (
	unrecordableErr = status.Error(codes.Internal, "idemkey: the reply of this call could not be recorded")
	unrecordable    = mustEncodeStatus(unrecordableErr)
	tooLargeErr     = status.Error(codes.Internal, "idemkey: the reply of this call is too large to record")
	tooLarge        = mustEncodeStatus(tooLargeErr)
	noRoomErr       = status.Error(codes.Internal, "idemkey: the reply of this call could not be recorded: the idempotency store is full")
	noRoom          = mustEncodeStatus(noRoomErr) // within store.SmallOutcome
)

func mustEncodeStatus(err error) []byte {
	raw, encodeErr := encodeStatus(status.Convert(err), &idemkeyv1.Outcome{})
	if encodeErr != nil {
		panic(encodeErr) // only a detail that cannot be marshalled fails, and these have none
	}
	return raw
}

// recorded is an outcome read back from its record.
type recorded struct {
	resp            any   // the response, when the handler succeeded
	err             error // the handler's error, otherwise
	header, trailer metadata.MD
}

// decodeOutcome reads a recorded outcome back, its response a message of type
// output. An error means the record cannot be read; a corrupt record never
// panics.
func decodeOutcome(raw []byte, output protoreflect.MessageType) (recorded, error) {
	if b, ok := responseAlone(raw); ok {
		resp := output.New().Interface()
		if err := proto.Unmarshal(b, resp); err != nil {
			return recorded{}, err
		}
		return recorded{resp: resp}, nil
	}
	out, resp, err := protokey.DecodeOutcome(raw, output)
	if err != nil {
		return recorded{}, err
	}
	rec := recorded{resp: resp, header: toMD(out.GetHeader()), trailer: toMD(out.GetTrailer())}
	if st := out.GetStatus(); resp == nil {
		rec.err = status.ErrorProto(&spb.Status{Code: st.GetCode(), Message: string(st.GetMessage()), Details: st.GetDetails()})
	}
	return rec, nil
}

// outcomeResponse is the field number of Outcome.response.
const outcomeResponse protowire.Number = 1

// responseAlone returns the response of a record that holds a response and
// nothing else (no metadata: most records), to read without the Outcome
// around it, as protokey.DecodeOutcome would read it; ok is false for any
// other record.
func responseAlone(raw []byte) (resp []byte, ok bool) {
	num, typ, n := protowire.ConsumeTag(raw)
	if n < 0 || num != outcomeResponse || typ != protowire.BytesType {
		return nil, false
	}
	resp, m := protowire.ConsumeBytes(raw[n:])
	return resp, m >= 0 && n+m == len(raw)
}

func toMD(entries []*idemkeyv1.MetadataEntry) metadata.MD {
	if len(entries) == 0 {
		return nil
	}
	md := make(metadata.MD, len(entries))
	for _, e := range entries {
		for _, v := range e.GetValues() {
			md[e.GetKey()] = append(md[e.GetKey()], string(v))
		}
	}
	return md
}

// recorder wraps a call's transport stream to keep a copy of the allow-listed
// header and trailer metadata the handler sets, for the record.
type recorder struct {
	grpc.ServerTransportStream
	allowed map[string]bool

	mu      sync.Mutex
	header  metadata.MD
	trailer metadata.MD
}

func (r *recorder) SetHeader(md metadata.MD) error {
	return r.keep(&r.header, md, r.ServerTransportStream.SetHeader(md))
}

func (r *recorder) SendHeader(md metadata.MD) error {
	return r.keep(&r.header, md, r.ServerTransportStream.SendHeader(md))
}

func (r *recorder) SetTrailer(md metadata.MD) error {
	return r.keep(&r.trailer, md, r.ServerTransportStream.SetTrailer(md))
}

// keep copies the allow-listed part of md into dst once gRPC has taken md
// (err is nil), and returns err.
func (r *recorder) keep(dst *metadata.MD, md metadata.MD, err error) error {
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, vs := range md {
		k = strings.ToLower(k)
		if !r.allowed[k] {
			continue
		}
		if *dst == nil {
			*dst = metadata.MD{}
		}
		(*dst)[k] = append((*dst)[k], vs...)
	}
	return nil
}

func (r *recorder) entries() (header, trailer []*idemkeyv1.MetadataEntry) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return toEntries(r.header), toEntries(r.trailer)
}

func toEntries(md metadata.MD) []*idemkeyv1.MetadataEntry {
	entries := make([]*idemkeyv1.MetadataEntry, 0, len(md))
	for _, k := range slices.Sorted(maps.Keys(md)) {
		values := make([][]byte, len(md[k]))
		for i, v := range md[k] {
			values[i] = []byte(v)
		}
		entries = append(entries, &idemkeyv1.MetadataEntry{Key: k, Values: values})
	}
	return entries
}
