package idemkey

import (
	"encoding/binary"
	"errors"
	"math"
	"reflect"
	"strings"
	"time"
)

// Reason returns the reason (ReasonKeyMissing and the others) of an error
// idemkey answered with over gRPC or Connect, wrapped or not, or "" when err
// is not idemkey's.
func Reason(err error) string {
	for _, d := range rpcDetails(err) {
		if d.name == "google.rpc.ErrorInfo" {
			var reason, domain string
			readFields(d.value, func(num uint64, _ uint64, b []byte) {
				switch num {
				case 1:
					reason = string(b)
				case 2:
					domain = string(b)
				}
			})
			if domain == ErrorDomain {
				return reason
			}
		}
	}
	return ""
}

// RetryDelay returns the wait an in-progress or store-full error asks of the
// client (its google.rpc.RetryInfo); ok is false when err carries none.
func RetryDelay(err error) (delay time.Duration, ok bool) {
	for _, d := range rpcDetails(err) {
		if d.name != "google.rpc.RetryInfo" {
			continue
		}
		readFields(d.value, func(num uint64, _ uint64, b []byte) {
			if num != 1 { // retry_delay, a google.protobuf.Duration
				return
			}
			var seconds, nanos int64
			readFields(b, func(num uint64, v uint64, _ []byte) {
				switch num {
				case 1:
					seconds = int64(v)
				case 2:
					nanos = int64(int32(v))
				}
			})
			delay, ok = durationOf(seconds, nanos), true
		})
		return delay, ok
	}
	return 0, false
}

// durationOf saturates as durationpb's AsDuration does: a hostile peer's
// delay never wraps around to a negative wait, nor a negative one to a positive.
func durationOf(seconds, nanos int64) time.Duration {
	d := time.Duration(seconds) * time.Second
	overflow := d/time.Second != time.Duration(seconds)
	d += time.Duration(nanos)
	overflow = overflow || seconds < 0 && nanos < 0 && d > 0 || seconds > 0 && nanos > 0 && d < 0
	switch {
	case !overflow:
		return d
	case seconds < 0:
		return math.MinInt64
	}
	return math.MaxInt64
}

// detail is a google.rpc detail: its message's full name and its bytes.
type detail struct {
	name  string
	value []byte
}

// rpcDetails returns the details of the first error in err's tree that
// carries some as grpc-go's (GRPCStatus().Proto().Details) or connect-go's
// (Details()) do. It reads them through reflect so that this package imports
// neither library nor protobuf: a net/http service would otherwise link 2.7
// MB it never calls.
func rpcDetails(err error) []detail {
	for err != nil {
		v := reflect.ValueOf(err)
		if st, ok := call(v, "GRPCStatus"); ok {
			if p, ok := call(st, "Proto"); ok && p.Kind() == reflect.Pointer && p.Elem().Kind() == reflect.Struct {
				return anyDetails(p.Elem().FieldByName("Details"))
			}
		}
		if ds, ok := call(v, "Details"); ok && ds.Kind() == reflect.Slice {
			var out []detail
			for i := range ds.Len() {
				typ, ok1 := call(ds.Index(i), "Type")
				b, ok2 := call(ds.Index(i), "Bytes")
				if ok1 && ok2 && typ.Kind() == reflect.String && b.Type() == reflect.TypeFor[[]byte]() {
					out = append(out, detail{typ.String(), b.Bytes()})
				}
			}
			return out
		}
		err = unwrapOne(err)
	}
	return nil
}

// unwrapOne is the error err wraps, the first of those it joins.
func unwrapOne(err error) error {
	if u := errors.Unwrap(err); u != nil {
		return u
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok && len(j.Unwrap()) > 0 {
		return j.Unwrap()[0]
	}
	return nil
}

// anyDetails reads a []*anypb.Any.
func anyDetails(ds reflect.Value) []detail {
	if ds.Kind() != reflect.Slice {
		return nil
	}
	var out []detail
	for i := range ds.Len() {
		a := ds.Index(i)
		if a.Kind() != reflect.Pointer || a.IsNil() || a.Elem().Kind() != reflect.Struct {
			continue
		}
		url, value := a.Elem().FieldByName("TypeUrl"), a.Elem().FieldByName("Value")
		if url.Kind() == reflect.String && value.IsValid() && value.Type() == reflect.TypeFor[[]byte]() {
			out = append(out, detail{url.String()[strings.LastIndexByte(url.String(), '/')+1:], value.Bytes()})
		}
	}
	return out
}

// call calls v's method name, which takes nothing and returns one value.
func call(v reflect.Value, name string) (reflect.Value, bool) {
	if !v.IsValid() || (v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface) && v.IsNil() {
		return reflect.Value{}, false
	}
	m := v.MethodByName(name)
	if !m.IsValid() || m.Type().NumIn() != 0 || m.Type().NumOut() != 1 {
		return reflect.Value{}, false
	}
	return m.Call(nil)[0], true
}

// readFields calls f with each varint or length-delimited field of the
// protobuf message b, up to the first it cannot read.
func readFields(b []byte, f func(num, v uint64, bytes []byte)) {
	for len(b) > 0 {
		tag, n := binary.Uvarint(b)
		if n <= 0 {
			return
		}
		b = b[n:]
		switch num := tag >> 3; tag & 7 {
		case 0: // varint
			v, n := binary.Uvarint(b)
			if n <= 0 {
				return
			}
			f(num, v, nil)
			b = b[n:]
		case 1: // 64-bit
			if len(b) < 8 {
				return
			}
			b = b[8:]
		case 2: // length-delimited
			l, n := binary.Uvarint(b)
			if n <= 0 || l > uint64(len(b)-n) {
				return
			}
			f(num, 0, b[n:n+int(l)])
			b = b[n+int(l):]
		case 5: // 32-bit
			if len(b) < 4 {
				return
			}
			b = b[4:]
		default:
			return
		}
	}
}
