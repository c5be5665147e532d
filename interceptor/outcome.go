package interceptor

import (
	"strings"
	"sync"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/protokey/rpckit"
)

// encode turns the handler's result into a record, or record false to
// release the key. A redaction changes a copy, not the caller's result.
func (x *exchange) encode() (raw []byte, record bool, err error) {
	resp, herr, o := x.resp, x.err, x.s.opts
	var st *idemkeyv1.Status
	if herr != nil {
		if st = statusOf(herr); !o.Records(st.Code) {
			return nil, false, nil
		}
	}
	msg, _ := resp.(proto.Message)
	var header, trailer []*idemkeyv1.MetadataEntry
	switch {
	case o.Redact != nil:
		reply := &Reply{Err: herr}
		var name protoreflect.FullName
		if herr == nil && msg != nil {
			reply.Response, name = proto.Clone(msg), msg.ProtoReflect().Descriptor().FullName()
		}
		if r := x.rec; r != nil {
			r.mu.Lock()
			reply.Header, reply.Trailer = r.header.Copy(), r.trailer.Copy()
			r.mu.Unlock()
		}
		if err := rpckit.Redact(herr, name, &reply.Err, &reply.Response, func() { o.Redact(x.ctx, x.m.Name, reply) }); err != nil {
			return nil, false, err
		}
		msg, st = reply.Response, nil
		if reply.Err != nil {
			st = statusOf(reply.Err)
		}
		header, trailer = rpckit.Entries(reply.Header), rpckit.Entries(reply.Trailer)
	case x.rec != nil:
		x.rec.mu.Lock()
		header, trailer = rpckit.Entries(x.rec.header), rpckit.Entries(x.rec.trailer)
		x.rec.mu.Unlock()
	}
	raw, err = rpckit.Encode(msg, st, header, trailer)
	return raw, err == nil, err
}

// statusOf is the status gRPC sends for a handler's error: a context error,
// even wrapped, is Canceled or DeadlineExceeded rather than Unknown.
func statusOf(err error) *idemkeyv1.Status {
	st, ok := status.FromError(err)
	if !ok {
		st = status.FromContextError(err)
	}
	p := st.Proto()
	return &idemkeyv1.Status{Code: p.Code, Message: []byte(p.Message), Details: p.Details}
}

func toError(st *idemkeyv1.Status) error {
	return status.ErrorProto(&spb.Status{Code: st.GetCode(), Message: string(st.GetMessage()), Details: st.GetDetails()})
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

// recorder keeps a copy of the allow-listed metadata the handler sets.
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

// keep copies the allow-listed part of md into dst if gRPC took md.
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
