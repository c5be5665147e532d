// Package protohash is the canonical fingerprint of a protobuf request,
// the encoder behind protokey.HashRequest.
package protohash

import (
	"cmp"
	"crypto/sha256"
	"math"
	"slices"
	"strings"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/idemkey/idemkey/store"
)

// Hash is protokey.HashRequest (docs/grpc.md, "The fingerprint", states the
// canonical encoding) with the field skip of req's own message left out (nil leaves
// out nothing): a request's AIP-155 request_id, which carries the key rather
// than the request. It lives here so that protokey, which users read, and
// protokey/rpckit, the adapters' kit, share it without either exporting it
// from the other.
func Hash(fullMethod string, req proto.Message, skip protoreflect.FieldDescriptor) store.Fingerprint {
	e := encoders.Get().(*encoder)
	defer e.release()
	e.skip = skip
	e.buf = store.AppendParts(e.buf[:0], fullMethod)
	if req != nil {
		e.buf = e.appendRequest(e.buf, req)
	}
	return sha256.Sum256(e.buf)
}

// appendRequest appends the canonical encoding of req: its deterministic
// marshalling where that is the same (marshalsCanonically), which
// protobuf-go's generated code writes in about half the time of
// appendMessage's reflection.
func (e *encoder) appendRequest(b []byte, req proto.Message) []byte {
	m := req.ProtoReflect()
	if e.skip == nil && marshalsCanonically(m) {
		// An error (a proto3 string that is not UTF-8) leaves it to appendMessage.
		if out, err := (proto.MarshalOptions{Deterministic: true, AllowPartial: true}).MarshalAppend(b, req); err == nil {
			return out
		}
	}
	return e.appendMessage(b, m)
}

// marshalsCanonically reports whether m's deterministic marshalling is its
// canonical encoding (HashRequest): m and the messages in it have no
// unknown fields, and their types no maps, no oneofs but proto3 optional
// fields' and no extensions, which protobuf-go writes out of number order.
func marshalsCanonically(m protoreflect.Message) bool {
	md := m.Descriptor()
	if len(m.GetUnknown()) > 0 || md.ExtensionRanges().Len() > 0 {
		return false
	}
	oneofs := md.Oneofs()
	for i := range oneofs.Len() {
		if !oneofs.Get(i).IsSynthetic() {
			return false
		}
	}
	fields := md.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		switch {
		case fd.Message() == nil:
		case fd.IsMap():
			return false
		case !m.Has(fd):
		case fd.IsList():
			l := m.Get(fd).List()
			for j := range l.Len() {
				if !marshalsCanonically(l.Get(j).Message()) {
					return false
				}
			}
		case !marshalsCanonically(m.Get(fd).Message()):
			return false
		}
	}
	return true
}

var encoders = sync.Pool{New: func() any { return new(encoder) }}

// encoder writes canonical encodings. Its slices are stacks: each message
// (or map) being encoded holds the top of one while it is written, and
// indexes it rather than keep a subslice, which a sub-message's pushes may
// move.
type encoder struct {
	buf     []byte
	fields  []protoreflect.FieldDescriptor // the set fields of each message, by number
	unknown []unknownField                 // the unknown fields of each message, by number
	entries []mapEntry                     // the entries of each map, by key
	skip    protoreflect.FieldDescriptor   // a field of the top message to leave out
}

// unknownField is one field of a message's unknown bytes, raw[start:end].
type unknownField struct {
	num        protowire.Number
	start, end int
}

type mapEntry struct {
	key protoreflect.MapKey
	val protoreflect.Value
}

// release returns e to the pool, dropping what a large request left behind
// and every reference into the request.
func (e *encoder) release() {
	if cap(e.buf) > 64<<10 {
		e.buf = nil
	}
	clear(e.fields[:cap(e.fields)])
	clear(e.entries[:cap(e.entries)])
	e.skip = nil
	if cap(e.fields) > 1024 || cap(e.unknown) > 1024 || cap(e.entries) > 1024 {
		*e = encoder{buf: e.buf}
	}
	encoders.Put(e)
}

// appendMessage appends the canonical encoding of m. It finds the set fields
// with Has rather than Range, which orders them no better and whose closure
// costs an allocation: Range only finds the extensions.
func (e *encoder) appendMessage(b []byte, m protoreflect.Message) []byte {
	md := m.Descriptor()
	firstField := len(e.fields)
	fields := md.Fields()
	skip := e.skip
	e.skip = nil // only the top message's own field
	for i := range fields.Len() {
		if fd := fields.Get(i); m.Has(fd) && fd != skip {
			e.fields = append(e.fields, fd)
		}
	}
	if md.ExtensionRanges().Len() > 0 {
		m.Range(func(fd protoreflect.FieldDescriptor, _ protoreflect.Value) bool {
			if fd.IsExtension() {
				e.fields = append(e.fields, fd)
			}
			return true
		})
	}
	endField := len(e.fields)
	slices.SortFunc(e.fields[firstField:], func(x, y protoreflect.FieldDescriptor) int {
		return cmp.Compare(x.Number(), y.Number())
	})

	raw := m.GetUnknown()
	firstUnknown, parsed := len(e.unknown), 0
	for parsed < len(raw) {
		num, _, n := protowire.ConsumeField(raw[parsed:])
		if n < 0 {
			break
		}
		e.unknown = append(e.unknown, unknownField{num, parsed, parsed + n})
		parsed += n
	}
	endUnknown := len(e.unknown)
	slices.SortStableFunc(e.unknown[firstUnknown:], func(x, y unknownField) int {
		return cmp.Compare(x.num, y.num)
	})

	for i, j := firstField, firstUnknown; i < endField || j < endUnknown; {
		if j == endUnknown || i < endField && e.fields[i].Number() <= e.unknown[j].num {
			b = e.appendField(b, m, e.fields[i])
			i++
		} else {
			b = appendUnknown(b, raw[e.unknown[j].start:e.unknown[j].end])
			j++
		}
	}
	e.fields, e.unknown = e.fields[:firstField], e.unknown[:firstUnknown]
	return append(b, raw[parsed:]...)
}

func (e *encoder) appendField(b []byte, m protoreflect.Message, fd protoreflect.FieldDescriptor) []byte {
	v := m.Get(fd)
	switch {
	case fd.IsMap():
		return e.appendMap(b, fd, v.Map())
	case fd.IsList():
		return e.appendList(b, fd, v.List())
	}
	return e.appendValue(protowire.AppendTag(b, fd.Number(), wireType(fd.Kind())), fd, v)
}

func (e *encoder) appendList(b []byte, fd protoreflect.FieldDescriptor, l protoreflect.List) []byte {
	if fd.IsPacked() {
		b = protowire.AppendTag(b, fd.Number(), protowire.BytesType)
		at := len(b)
		b = append(b, 0)
		for i := range l.Len() {
			b = e.appendValue(b, fd, l.Get(i))
		}
		return fillLength(b, at)
	}
	wt := wireType(fd.Kind())
	for i := range l.Len() {
		b = e.appendValue(protowire.AppendTag(b, fd.Number(), wt), fd, l.Get(i))
	}
	return b
}

func (e *encoder) appendMap(b []byte, fd protoreflect.FieldDescriptor, mv protoreflect.Map) []byte {
	first := len(e.entries)
	mv.Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
		e.entries = append(e.entries, mapEntry{k, v})
		return true
	})
	end := len(e.entries)
	kd, vd := fd.MapKey(), fd.MapValue()
	slices.SortFunc(e.entries[first:], keyOrder(kd.Kind()))
	kt, vt := protowire.EncodeTag(1, wireType(kd.Kind())), protowire.EncodeTag(2, wireType(vd.Kind()))
	for i := first; i < end; i++ {
		b = protowire.AppendTag(b, fd.Number(), protowire.BytesType)
		at := len(b)
		b = append(b, 0)
		b = e.appendValue(protowire.AppendVarint(b, kt), kd, e.entries[i].key.Value())
		b = e.appendValue(protowire.AppendVarint(b, vt), vd, e.entries[i].val)
		b = fillLength(b, at)
	}
	e.entries = e.entries[:first]
	return b
}

// keyOrder is the order of map keys of kind k: false before true, integers
// numerically, strings bytewise, as protobuf-go's deterministic marshalling.
func keyOrder(k protoreflect.Kind) func(x, y mapEntry) int {
	switch k {
	case protoreflect.BoolKind:
		return func(x, y mapEntry) int {
			switch xb, yb := x.key.Bool(), y.key.Bool(); {
			case xb == yb:
				return 0
			case yb:
				return -1
			}
			return 1
		}
	case protoreflect.StringKind:
		return func(x, y mapEntry) int { return strings.Compare(x.key.String(), y.key.String()) }
	case protoreflect.Uint32Kind, protoreflect.Uint64Kind, protoreflect.Fixed32Kind, protoreflect.Fixed64Kind:
		return func(x, y mapEntry) int { return cmp.Compare(x.key.Uint(), y.key.Uint()) }
	}
	return func(x, y mapEntry) int { return cmp.Compare(x.key.Int(), y.key.Int()) }
}

// appendValue appends one value of fd, without its tag, except the end tag
// of a group.
func (e *encoder) appendValue(b []byte, fd protoreflect.FieldDescriptor, v protoreflect.Value) []byte {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		return protowire.AppendVarint(b, protowire.EncodeBool(v.Bool()))
	case protoreflect.EnumKind:
		return protowire.AppendVarint(b, uint64(v.Enum()))
	case protoreflect.Int32Kind, protoreflect.Int64Kind:
		return protowire.AppendVarint(b, uint64(v.Int()))
	case protoreflect.Sint32Kind, protoreflect.Sint64Kind:
		return protowire.AppendVarint(b, protowire.EncodeZigZag(v.Int()))
	case protoreflect.Uint32Kind, protoreflect.Uint64Kind:
		return protowire.AppendVarint(b, v.Uint())
	case protoreflect.Sfixed32Kind:
		return protowire.AppendFixed32(b, uint32(v.Int()))
	case protoreflect.Fixed32Kind:
		return protowire.AppendFixed32(b, uint32(v.Uint()))
	case protoreflect.FloatKind:
		return protowire.AppendFixed32(b, math.Float32bits(float32(v.Float())))
	case protoreflect.Sfixed64Kind:
		return protowire.AppendFixed64(b, uint64(v.Int()))
	case protoreflect.Fixed64Kind:
		return protowire.AppendFixed64(b, v.Uint())
	case protoreflect.DoubleKind:
		return protowire.AppendFixed64(b, math.Float64bits(v.Float()))
	case protoreflect.StringKind:
		return protowire.AppendString(b, v.String())
	case protoreflect.BytesKind:
		return protowire.AppendBytes(b, v.Bytes())
	case protoreflect.MessageKind:
		at := len(b)
		b = e.appendMessage(append(b, 0), v.Message())
		return fillLength(b, at)
	case protoreflect.GroupKind:
		b = e.appendMessage(b, v.Message())
		return protowire.AppendTag(b, fd.Number(), protowire.EndGroupType)
	}
	return b // no other kind exists
}

func wireType(k protoreflect.Kind) protowire.Type {
	switch k {
	case protoreflect.Sfixed32Kind, protoreflect.Fixed32Kind, protoreflect.FloatKind:
		return protowire.Fixed32Type
	case protoreflect.Sfixed64Kind, protoreflect.Fixed64Kind, protoreflect.DoubleKind:
		return protowire.Fixed64Type
	case protoreflect.StringKind, protoreflect.BytesKind, protoreflect.MessageKind:
		return protowire.BytesType
	case protoreflect.GroupKind:
		return protowire.StartGroupType
	}
	return protowire.VarintType
}

// fillLength writes the length of b[at+1:] at b[at], where one byte was kept
// for it, and moves those bytes up if the length needs more.
func fillLength(b []byte, at int) []byte {
	n := len(b) - at - 1
	if n < 0x80 {
		b[at] = byte(n)
		return b
	}
	w := protowire.SizeVarint(uint64(n))
	b = append(b, make([]byte, w-1)...)
	copy(b[at+w:], b[at+1:at+1+n])
	protowire.AppendVarint(b[:at], uint64(n))
	return b
}

// appendUnknown appends one unknown field, f, which protowire.ConsumeField
// accepted, with its tag and varints minimal.
func appendUnknown(b, f []byte) []byte {
	num, typ, n := protowire.ConsumeTag(f)
	b = protowire.AppendTag(b, num, typ)
	f = f[n:]
	switch typ {
	case protowire.VarintType:
		v, _ := protowire.ConsumeVarint(f)
		return protowire.AppendVarint(b, v)
	case protowire.BytesType:
		v, _ := protowire.ConsumeBytes(f)
		return protowire.AppendBytes(b, v)
	}
	return append(b, f...) // I32, I64, or a group's fields and end tag
}
