package idemhttp

import (
	"bytes"
	"net/http"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
)

// recordCases are responses to record: the header holds fields on the
// default replay list and off it.
var recordCases = []struct {
	name   string
	status int
	header http.Header
	body   []byte
}{
	{"created", http.StatusCreated, http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/charges/ch_1"}, "X-Trace": {"t"}}, []byte(`{"id":"ch_1"}`)},
	{"no body", http.StatusNoContent, http.Header{"Content-Language": {"en", "de"}}, nil},
	{"empty value", http.StatusOK, http.Header{"Content-Encoding": {""}, "Content-Type": {}}, []byte("x")},
	{"nothing replayed", 999, http.Header{"Set-Cookie": {"a=b"}}, bytes.Repeat([]byte{0, 0xff}, 300)},
}

// TestRecordIsTheProtobufMessage holds the record's hand-written encoding to
// the generated code's: proto.Marshal of the same Outcome writes the same
// bytes, and proto.Unmarshal reads them back as the response; decodeRecord
// reads what proto.Marshal writes.
func TestRecordIsTheProtobufMessage(t *testing.T) {
	o := newOptions(nil)
	for _, c := range recordCases {
		t.Run(c.name, func(t *testing.T) {
			got, err := encodeRecord(c.status, c.header, c.body, o.replayList)
			if err != nil {
				t.Fatal(err)
			}
			want, err := proto.Marshal(generated(c.status, c.header, c.body, o))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("encodeRecord = %x, proto.Marshal = %x", got, want)
			}
			resp, err := decodeRecord(want)
			if err != nil {
				t.Fatal(err)
			}
			if resp.status != c.status || !bytes.Equal(resp.body, c.body) {
				t.Fatalf("decodeRecord: status %d, body %q; want %d, %q", resp.status, resp.body, c.status, c.body)
			}
			if got, want := headerOf(&resp), generated(c.status, c.header, c.body, o).GetHttp().GetHeader(); !sameEntries(got, want) {
				t.Fatalf("decodeRecord: header %v, want %v", got, want)
			}
		})
	}
}

// generated is the Outcome of a response as the generated code builds it:
// the fields on the replay list, sorted, in lower case.
func generated(status int, header http.Header, body []byte, o *options) *idemkeyv1.Outcome {
	resp := &idemkeyv1.HTTPResponse{Status: int32(status), Body: body}
	for _, n := range o.replayList {
		if vs := header[n.canonical]; len(vs) > 0 {
			values := make([][]byte, len(vs))
			for i, v := range vs {
				values[i] = []byte(v)
			}
			resp.Header = append(resp.Header, &idemkeyv1.MetadataEntry{Key: n.wire, Values: values})
		}
	}
	return &idemkeyv1.Outcome{Result: &idemkeyv1.Outcome_Http{Http: resp}}
}

// headerOf is the header entries decodeRecord read, as MetadataEntry messages.
func headerOf(resp *recordedResponse) []*idemkeyv1.MetadataEntry {
	var entries []*idemkeyv1.MetadataEntry
	resp.eachHeader(func(key, entry []byte) {
		e := &idemkeyv1.MetadataEntry{Key: string(key)}
		eachValue(entry, func(v []byte) { e.Values = append(e.Values, v) })
		entries = append(entries, e)
	})
	return entries
}

func sameEntries(a, b []*idemkeyv1.MetadataEntry) bool {
	return slices.EqualFunc(a, b, func(x, y *idemkeyv1.MetadataEntry) bool {
		return x.GetKey() == y.GetKey() && slices.EqualFunc(x.GetValues(), y.GetValues(), bytes.Equal)
	})
}

// FuzzRecord reads arbitrary bytes as a record: decodeRecord never panics,
// and reads every record that proto.Unmarshal reads as an HTTP response with
// a final status as proto.Unmarshal reads it.
func FuzzRecord(f *testing.F) {
	o := newOptions(nil)
	for _, c := range recordCases {
		raw, err := encodeRecord(c.status, c.header, c.body, o.replayList)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(raw)
		f.Add(append(slices.Clone(raw), raw...)) // a second response merges into the first
	}
	grpc, _ := proto.Marshal(&idemkeyv1.Outcome{Result: &idemkeyv1.Outcome_Response{Response: []byte{1}}})
	f.Add(grpc)
	f.Add([]byte{0x2a, 0x03, 0x08, 0xc8, 0x01}) // status 200
	f.Fuzz(func(t *testing.T, raw []byte) {
		resp, err := decodeRecord(raw)
		var out idemkeyv1.Outcome
		if proto.Unmarshal(raw, &out) != nil || out.GetHttp() == nil || out.GetHttp().GetStatus() < 200 || out.GetHttp().GetStatus() > 999 {
			return
		}
		want := out.GetHttp()
		switch {
		case err != nil:
			t.Fatalf("decodeRecord: %v; proto.Unmarshal reads %v", err, want)
		case resp.status != int(want.GetStatus()) || !bytes.Equal(resp.body, want.GetBody()):
			t.Fatalf("decodeRecord: status %d, body %q; proto.Unmarshal reads %v", resp.status, resp.body, want)
		case !sameEntries(headerOf(&resp), want.GetHeader()):
			t.Fatalf("decodeRecord: header %v; proto.Unmarshal reads %v", headerOf(&resp), want.GetHeader())
		}
	})
}
