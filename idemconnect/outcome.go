package idemconnect

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"

	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/protokey/rpckit"
)

// encode turns the handler's result into the gRPC interceptor's record, or
// record false to release the key. A redaction changes a copy.
func (x *exchange) encode(k *kept) (raw []byte, record bool, err error) {
	herr, o := x.err, x.s.opts
	var st *idemkeyv1.Status
	if herr != nil {
		if st = statusOf(herr); !o.Records(st.Code) {
			return nil, false, nil
		}
	}
	var msg proto.Message
	if herr == nil {
		msg, _ = x.resp.Any().(proto.Message)
	}
	var header, trailer []*idemkeyv1.MetadataEntry
	if k != nil {
		header, trailer = rpckit.Entries(k.header), rpckit.Entries(k.trailer)
	}
	if o.Redact != nil {
		reply := &Reply{Err: herr}
		var name protoreflect.FullName
		if msg != nil {
			reply.Response, name = proto.Clone(msg), msg.ProtoReflect().Descriptor().FullName()
		}
		if k != nil {
			reply.Header, reply.Trailer = toHeader(k.header), toHeader(k.trailer)
		}
		if err := rpckit.Redact(herr, name, &reply.Err, &reply.Response, func() { o.Redact(x.ctx, x.p.Name, reply) }); err != nil {
			return nil, false, err
		}
		msg, st = reply.Response, nil
		if reply.Err != nil {
			st = statusOf(reply.Err)
		}
		header, trailer = headerEntries(reply.Header), headerEntries(reply.Trailer)
	}
	raw, err = rpckit.Encode(msg, st, header, trailer)
	return raw, err == nil, err
}

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

func headerEntries(h http.Header) []*idemkeyv1.MetadataEntry {
	m := make(map[string][][]byte, len(h))
	for name, vs := range h {
		lower := strings.ToLower(name)
		for _, v := range vs {
			m[lower] = append(m[lower], []byte(v))
		}
	}
	return rpckit.Entries(m)
}

// statusOf is the status Connect sends for err: a context error, even
// wrapped, is Canceled or DeadlineExceeded; another non-Connect one Unknown.
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

// typeURLPrefix: Connect names a detail by its message's full name alone,
// gRPC by a type URL.
const typeURLPrefix = "type.googleapis.com/"

func toError(st *idemkeyv1.Status) *connect.Error {
	err := connect.NewError(connect.Code(st.GetCode()), errors.New(string(st.GetMessage())))
	for _, a := range st.GetDetails() {
		if d, derr := connect.NewErrorDetail(a); derr == nil { // an Any is kept as it is
			err.AddDetail(d)
		}
	}
	return err
}

// replayedMessage carries a replay's response, as an interceptor cannot name
// the handler's type; Connect's codecs marshal it as the message itself.
type replayedMessage struct{ proto.Message }

// kept is the allow-listed metadata of one call, lower-case, values decoded.
type kept struct {
	allowed         map[string]bool
	header, trailer map[string][][]byte
	before          map[string]int // values already in the CallInfo's header ("h:"+name) or trailer ("t:"+name) before the handler
}

// newKept keeps what the handler sets, apart from what outer interceptors
// set in its CallInfo before.
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

// add keeps the allow-listed part of h, past the values k.before counts.
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

func addEntries(h http.Header, entries []*idemkeyv1.MetadataEntry) {
	for _, e := range entries {
		name := e.GetKey()
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
