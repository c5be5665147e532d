package idemhttp

import (
	"errors"
	"fmt"
	"net/http"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
)

// The record of a response is an idemkey.v1.Outcome whose result is an
// HTTPResponse, written and read with protowire rather than the generated
// messages, which cost a dozen allocations a response: the bytes are
// proto.Marshal's, and a record is read as proto.Unmarshal reads it.
// record_test.go holds both to the generated code.

// Field numbers of outcome.proto.
const (
	outcomeResponse protowire.Number = 1 // Outcome.response, the oneof's gRPC reply
	outcomeStatus   protowire.Number = 2 // Outcome.status, the oneof's gRPC error
	outcomeHeader   protowire.Number = 3 // Outcome.header
	outcomeTrailer  protowire.Number = 4 // Outcome.trailer
	outcomeHTTP     protowire.Number = 5 // Outcome.http, the oneof's HTTP response

	responseStatus protowire.Number = 1 // HTTPResponse.status
	responseHeader protowire.Number = 2 // HTTPResponse.header
	responseBody   protowire.Number = 3 // HTTPResponse.body

	entryKey    protowire.Number = 1 // MetadataEntry.key
	entryValues protowire.Number = 2 // MetadataEntry.values
)

// replayedName is a header field on the replay list: its canonical name,
// and the lower-case one a record holds.
type replayedName struct{ canonical, wire string }

// encodeRecord is the record of a response with status, the fields of
// header on the replay list names (sorted by name), and body: one
// allocation. It fails for a field name that is not UTF-8, which a
// protobuf string cannot hold.
func encodeRecord(status int, header http.Header, body []byte, names []replayedName) ([]byte, error) {
	size := 0
	if status != 0 {
		size += protowire.SizeTag(responseStatus) + protowire.SizeVarint(uint64(int64(int32(status))))
	}
	for _, n := range names {
		if vs := header[n.canonical]; len(vs) > 0 {
			if !utf8.ValidString(n.wire) {
				return nil, fmt.Errorf("the header field name %q is not UTF-8", n.wire)
			}
			size += protowire.SizeTag(responseHeader) + protowire.SizeBytes(entrySize(n.wire, vs))
		}
	}
	if len(body) > 0 {
		size += protowire.SizeTag(responseBody) + protowire.SizeBytes(len(body))
	}
	b := make([]byte, 0, protowire.SizeTag(outcomeHTTP)+protowire.SizeBytes(size))
	b = protowire.AppendTag(b, outcomeHTTP, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(size))
	if status != 0 {
		b = protowire.AppendTag(b, responseStatus, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(int64(int32(status))))
	}
	for _, n := range names {
		vs := header[n.canonical]
		if len(vs) == 0 {
			continue
		}
		b = protowire.AppendTag(b, responseHeader, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(entrySize(n.wire, vs)))
		b = protowire.AppendTag(b, entryKey, protowire.BytesType)
		b = protowire.AppendString(b, n.wire)
		for _, v := range vs {
			b = protowire.AppendTag(b, entryValues, protowire.BytesType)
			b = protowire.AppendString(b, v)
		}
	}
	if len(body) > 0 {
		b = protowire.AppendTag(b, responseBody, protowire.BytesType)
		b = protowire.AppendBytes(b, body)
	}
	return b, nil
}

// entrySize is the size of the MetadataEntry of a field named key with values.
func entrySize(key string, values []string) int {
	n := protowire.SizeTag(entryKey) + protowire.SizeBytes(len(key))
	for _, v := range values {
		n += protowire.SizeTag(entryValues) + protowire.SizeBytes(len(v))
	}
	return n
}

// recordedResponse is a response read back from its record. Its body and
// header entries alias the record, which must not be modified.
type recordedResponse struct {
	status int
	body   []byte
	// The header entries, in the record's order: the first few here, the
	// rest in more.
	header  [4]headerEntry // as many as the default replay list names
	nHeader int
	more    []headerEntry
}

// headerEntry is a MetadataEntry of a response's header: its key, and the
// message, whose values eachValue reads.
type headerEntry struct{ key, entry []byte }

var errCorrupt = errors.New("the record is not a well-formed protobuf message")

// decodeRecord reads a record back; an error if it is not an HTTP
// response's (a gRPC call's, say) or is corrupt. It never panics.
func decodeRecord(raw []byte) (recordedResponse, error) {
	var resp recordedResponse
	isHTTP := false
	for b := raw; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return recordedResponse{}, errCorrupt
		}
		field := b[n:]
		m := protowire.ConsumeFieldValue(num, typ, field)
		if m < 0 {
			return recordedResponse{}, errCorrupt
		}
		value := field[:m]
		if typ == protowire.BytesType {
			value, _ = protowire.ConsumeBytes(value)
			switch num {
			case outcomeHTTP:
				if !isHTTP { // a new response: the oneof held none, or another member
					resp, isHTTP = recordedResponse{}, true
				}
				if err := resp.merge(value); err != nil {
					return recordedResponse{}, err
				}
			case outcomeResponse, outcomeStatus:
				isHTTP = false
			case outcomeHeader, outcomeTrailer:
				if _, err := readEntry(value, nil); err != nil {
					return recordedResponse{}, err
				}
			}
		}
		b = field[m:]
	}
	switch {
	case !isHTTP:
		return recordedResponse{}, errors.New("the record holds no HTTP response: another transport recorded it")
	case resp.status < 200 || resp.status > 999:
		return recordedResponse{}, fmt.Errorf("the recorded status %d is not a final status", resp.status)
	}
	return resp, nil
}

// merge reads one HTTPResponse field's message into r, as proto.Unmarshal
// merges a message field that occurs more than once.
func (r *recordedResponse) merge(msg []byte) error {
	return eachField(msg, func(num protowire.Number, typ protowire.Type, value []byte) error {
		switch {
		case num == responseStatus && typ == protowire.VarintType:
			v, _ := protowire.ConsumeVarint(value)
			r.status = int(int32(v))
		case num == responseBody && typ == protowire.BytesType:
			r.body, _ = protowire.ConsumeBytes(value)
		case num == responseHeader && typ == protowire.BytesType:
			entry, _ := protowire.ConsumeBytes(value)
			key, err := readEntry(entry, nil)
			if err != nil {
				return err
			}
			if e := (headerEntry{key, entry}); r.nHeader < len(r.header) {
				r.header[r.nHeader] = e
				r.nHeader++
			} else {
				r.more = append(r.more, e)
			}
		}
		return nil
	})
}

// eachHeader calls f with the key and the message of each header entry of
// r's response, in the record's order (eachValue reads its values).
func (r *recordedResponse) eachHeader(f func(key, entry []byte)) {
	for _, e := range r.header[:r.nHeader] {
		f(e.key, e.entry)
	}
	for _, e := range r.more {
		f(e.key, e.entry)
	}
}

// eachValue calls f with each value of a header entry that decodeRecord
// has read, in order.
func eachValue(entry []byte, f func(value []byte)) { _, _ = readEntry(entry, f) }

// readEntry reads a MetadataEntry: it returns its key, and calls value, if
// not nil, with each of its values. An error if it is corrupt, or its key
// is not UTF-8.
func readEntry(msg []byte, value func([]byte)) (key []byte, err error) {
	err = eachField(msg, func(num protowire.Number, typ protowire.Type, v []byte) error {
		if typ != protowire.BytesType {
			return nil
		}
		switch v, _ := protowire.ConsumeBytes(v); num {
		case entryKey:
			key = v
		case entryValues:
			if value != nil {
				value(v)
			}
		}
		return nil
	})
	if err == nil && !utf8.Valid(key) {
		err = errors.New("a recorded header field name is not UTF-8")
	}
	return key, err
}

// eachField calls f with each field of the protobuf message msg: its
// number, its wire type and its value as protowire.ConsumeFieldValue
// measures it (a bytes field's length in front). It stops at f's first
// error, and fails for a message that is not well formed.
func eachField(msg []byte, f func(num protowire.Number, typ protowire.Type, value []byte) error) error {
	for len(msg) > 0 {
		num, typ, n := protowire.ConsumeTag(msg)
		if n < 0 {
			return errCorrupt
		}
		msg = msg[n:]
		m := protowire.ConsumeFieldValue(num, typ, msg)
		if m < 0 {
			return errCorrupt
		}
		if err := f(num, typ, msg[:m]); err != nil {
			return err
		}
		msg = msg[m:]
	}
	return nil
}
