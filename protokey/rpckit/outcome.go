package rpckit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/idemkey/idemkey/engine"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/store"
)

// The record of a call is an idemkeyv1.Outcome, the same whichever adapter
// made it, so that a record made over one transport replays over the
// other: the response message's protobuf bytes, or the error's code,
// message and details (google.protobuf.Any, type URLs in gRPC's form), and
// the replayed header and trailer entries under lower-case names, binary
// values decoded.

// Encode returns the record of a call whose handler returned resp, or an
// error of status st, with the kept metadata header and trailer. A response
// is marshalled straight into its field, not copied: the hot path of every
// first call.
func Encode(resp proto.Message, st *idemkeyv1.Status, header, trailer []*idemkeyv1.MetadataEntry) ([]byte, error) {
	var out *idemkeyv1.Outcome // the kept metadata; nil, as for most calls, without any
	if len(header) > 0 || len(trailer) > 0 || st != nil {
		out = &idemkeyv1.Outcome{Header: header, Trailer: trailer}
	}
	if st != nil {
		out.Result = &idemkeyv1.Outcome_Status{Status: st}
		return proto.Marshal(out)
	}
	if resp == nil {
		return nil, errors.New("the response is not a protobuf message")
	}
	size := proto.Size(resp)
	raw := make([]byte, 0, size+protowire.SizeVarint(uint64(size))+1+proto.Size(out))
	raw = protowire.AppendTag(raw, outcomeResponse, protowire.BytesType)
	raw = protowire.AppendVarint(raw, uint64(size))
	raw, err := proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(raw, resp)
	if err != nil || out == nil {
		return raw, err
	}
	return proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(raw, out)
}

const outcomeResponse protowire.Number = 1

// Recorded is an outcome read back from its record: Response, a message of
// the method's output type, when the handler succeeded, and otherwise
// Status, whose code is not OK.
type Recorded struct {
	Response        proto.Message
	Status          *idemkeyv1.Status
	Header, Trailer []*idemkeyv1.MetadataEntry
}

// Read reads the record raw of a call of m back. A record that cannot be
// read (a corrupt record never panics) is logged at Error and answered by
// the Internal status st.
func (m *Method) Read(ctx context.Context, log *slog.Logger, raw []byte) (rec Recorded, st *idemkeyv1.Status) {
	rec, err := decode(raw, m.Output)
	if err != nil {
		log.LogAttrs(ctx, slog.LevelError, "idemkey: recorded outcome is corrupt",
			slog.String("operation", m.Name), slog.Any("error", err))
		return Recorded{}, Internal("idemkey: the recorded outcome of this call cannot be read")
	}
	return rec, nil
}

// decode reads a record, its response a message of type output.
func decode(raw []byte, output protoreflect.MessageType) (Recorded, error) {
	if b, ok := responseAlone(raw); ok {
		resp := output.New().Interface()
		if err := proto.Unmarshal(b, resp); err != nil {
			return Recorded{}, err
		}
		return Recorded{Response: resp}, nil
	}
	out := &idemkeyv1.Outcome{}
	if err := proto.Unmarshal(raw, out); err != nil {
		return Recorded{}, err
	}
	rec := Recorded{Header: out.GetHeader(), Trailer: out.GetTrailer()}
	switch r := out.GetResult().(type) {
	case *idemkeyv1.Outcome_Response:
		rec.Response = output.New().Interface()
		if err := proto.Unmarshal(r.Response, rec.Response); err != nil {
			return Recorded{}, err
		}
		return rec, nil
	case *idemkeyv1.Outcome_Status:
		if r.Status.GetCode() == 0 {
			return Recorded{}, errors.New("recorded error has code OK")
		}
		rec.Status = r.Status
		return rec, nil
	}
	return Recorded{}, errors.New("recorded outcome holds neither a response nor an error")
}

// responseAlone returns the response of a record that holds a response and
// nothing else (no metadata: most records), to read without the Outcome
// around it; ok is false for any other record.
func responseAlone(raw []byte) (resp []byte, ok bool) {
	num, typ, n := protowire.ConsumeTag(raw)
	if n < 0 || num != outcomeResponse || typ != protowire.BytesType {
		return nil, false
	}
	resp, m := protowire.ConsumeBytes(raw[n:])
	return resp, m >= 0 && n+m == len(raw)
}

// Entries is the record of metadata m (gRPC's metadata.MD, or names to
// decoded values), in the order of its names, which must be lower case.
func Entries[V string | []byte](m map[string][]V) []*idemkeyv1.MetadataEntry {
	entries := make([]*idemkeyv1.MetadataEntry, 0, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		values := make([][]byte, len(m[k]))
		for i, v := range m[k] {
			values[i] = []byte(v)
		}
		entries = append(entries, &idemkeyv1.MetadataEntry{Key: k, Values: values})
	}
	return entries
}

// Allowed is the entries whose names are in allowed: the allow-list of
// today applies to a replay, not the one the record was made under.
func Allowed(entries []*idemkeyv1.MetadataEntry, allowed map[string]bool) []*idemkeyv1.MetadataEntry {
	var out []*idemkeyv1.MetadataEntry
	for _, e := range entries {
		if allowed[e.GetKey()] {
			out = append(out, e)
		}
	}
	return out
}

// The stand-ins are the outcomes recorded when the handler's own cannot be:
// the handler ran, so its key must not be released. The caller gets the
// error too, as every retry does.
var (
	unrecordable = standIn("idemkey: the reply of this call could not be recorded")
	tooLarge     = standIn("idemkey: the reply of this call is too large to record")
	noRoom       = standIn("idemkey: the reply of this call could not be recorded: the idempotency store is full") // within store.SmallOutcome
)

type standInRecord struct {
	raw []byte
	msg string
}

func standIn(msg string) standInRecord {
	raw, err := Encode(nil, Internal(msg), nil, nil)
	if err != nil {
		panic(err) // a status without details always marshals
	}
	return standInRecord{raw, msg}
}

// StandIn returns the record made in place of a reply that cannot be
// recorded (why: engine.Exchange.StandIn's), and its Internal status, which
// the caller gets.
func StandIn(why error) (raw []byte, st *idemkeyv1.Status) {
	s := unrecordable
	switch {
	case errors.Is(why, engine.ErrTooLarge):
		s = tooLarge
	case errors.Is(why, store.ErrFull):
		s = noRoom
	}
	return s.raw, Internal(s.msg)
}

// Redact calls redact on a copy of the handler's result (errp, respp) and
// returns an error if what it left cannot be recorded: it panicked, turned
// an error into a response, left neither, or changed the response's type.
// The handler has run, so Internal is then recorded, not the key released.
func Redact(herr error, name protoreflect.FullName, errp *error, respp *proto.Message, redact func()) (err error) {
	defer func() {
		if p := recover(); p != nil {
			// A redaction function handles secrets: its panic's words may
			// quote the reply it was removing them from.
			err = fmt.Errorf("the redaction function panicked with a value of type %T (its words are not logged: they may quote the reply)", p)
		}
	}()
	redact()
	switch resp := *respp; {
	case *errp != nil:
	case herr != nil:
		return errors.New("the redaction function turned an error into a response")
	case resp == nil:
		return errors.New("the redaction function left neither a response nor an error")
	case resp.ProtoReflect().Descriptor().FullName() != name:
		return fmt.Errorf("the redaction function replaced the %s response by a %s", name, resp.ProtoReflect().Descriptor().FullName())
	}
	return nil
}
