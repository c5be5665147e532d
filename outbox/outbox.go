package outbox

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// Message is a message for a broker, which a Relay sends once the
// transaction that published it has committed.
type Message struct {
	// ID is the message's id, which the Relay sends as the broker's
	// duplicate id (Nats-Msg-Id, message-id) and idemkey's consumers read
	// as its key. Publish derives it from the call's key and the message's
	// place in the call (engine.NextMessageID); outside a call that holds a
	// key, it makes a random one. Set it only to an id that every run of
	// the operation makes again.
	ID string
	// Destination is where the message goes: a NATS subject, a RabbitMQ
	// routing key, a Kafka topic. 1 to 255 bytes of printable UTF-8.
	Destination string
	// PartitionKey orders messages: a partition's are sent one after
	// another, in the order they were written, and Kafka's record key is
	// it. If it is empty, Publish sets the call's own (one partition per
	// key) for a message whose ID it makes, and the message's ID (a
	// partition of its own) for one published with an ID, or outside a call.
	PartitionKey string
	// Headers go with the message as the broker's headers: names of 1 to
	// 128 bytes of visible ASCII but ':', values without line breaks.
	Headers map[string]string
	Payload []byte
}

// defaultMaxMessageSize bounds a message's payload and headers: below NATS's
// default limit and a Kafka producer's (about 1 MB each), with room for
// their envelopes.
const defaultMaxMessageSize = 900_000

// Outbox writes a handler's messages to a store's outbox, in the handler's
// transaction. It is safe for concurrent use.
type Outbox struct {
	st      store.Outbox
	sealer  engine.Sealer
	maxSize int
}

// Option configures an Outbox.
type Option func(*options)

type options struct {
	sealer  engine.Sealer
	maxSize int
}

// WithSealer seals each message's headers and payload in the table, as
// engine.WithSealer seals records: give both the same *seal.KeyRing. The
// Relay opens them with it.
func WithSealer(s engine.Sealer) Option {
	if v := reflect.ValueOf(s); v.Kind() == reflect.Pointer && v.IsNil() {
		s = nil // a nil *seal.KeyRing, say: none
	}
	return func(o *options) { o.sealer = s }
}

// WithMaxMessageSize bounds a message's payload and headers; Publish refuses a
// larger one. 900,000 bytes by default: below NATS's default limit and a Kafka
// producer's (about 1 MB each), with room for their envelopes. Keep it
// below your broker's: a larger message is never sent, and holds back its
// partition.
func WithMaxMessageSize(n int) Option { return func(o *options) { o.maxSize = n } }

// New returns the outbox of st: a *postgres.Store's is the table
// "<table>_outbox" (migration 004).
func New(st store.Outbox, opts ...Option) (*Outbox, error) {
	o := options{maxSize: defaultMaxMessageSize}
	for _, opt := range opts {
		opt(&o)
	}
	if v := reflect.ValueOf(st); st == nil || v.Kind() == reflect.Pointer && v.IsNil() {
		return nil, errors.New("idemkey outbox: New needs a store, not nil")
	}
	if o.maxSize < 1 {
		return nil, fmt.Errorf("idemkey outbox: WithMaxMessageSize(%d): want at least 1", o.maxSize)
	}
	return &Outbox{st: st, sealer: o.sealer, maxSize: o.maxSize}, nil
}

// Publish writes ms in the transaction of the handler whose ctx is, which
// ctx carries: in atomic mode the call's own (postgres.TxFromContext); a
// two-phase handler gives its own with postgres.ContextWithTx. The messages
// exist if and only if it commits, and a Relay sends them then. Without a
// transaction, Publish writes nothing and returns an error. A message whose
// id the outbox holds (a re-run's copy) is dropped. Publish refuses a
// message with no destination, or larger than WithMaxMessageSize, writing
// none of ms; its errors never quote a message.
func (o *Outbox) Publish(ctx context.Context, ms ...Message) error {
	for i, m := range ms { // all before any: a refused message takes no number
		if err := check(m); err != nil {
			return fmt.Errorf("idemkey outbox: message %d of %d: %w", i+1, len(ms), err)
		}
	}
	rows := make([]store.OutboxMessage, len(ms))
	for i, m := range ms {
		if m.ID == "" {
			id, partition, ok := engine.NextMessageID(ctx)
			if !ok {
				id = idemkey.NewKey()
				partition = id
			}
			m.ID = id
			if m.PartitionKey == "" {
				m.PartitionKey = partition
			}
		}
		if m.PartitionKey == "" {
			m.PartitionKey = m.ID
		}
		body := encode(m)
		if len(body) > o.maxSize {
			return fmt.Errorf("idemkey outbox: message %d of %d: its payload and headers are %d bytes, more than the %d of WithMaxMessageSize", i+1, len(ms), len(body), o.maxSize)
		}
		if o.sealer != nil {
			var err error
			if body, err = o.sealer.Seal(messageKey(m), body); err != nil {
				return fmt.Errorf("idemkey outbox: sealing message %d of %d: %w", i+1, len(ms), err)
			}
		}
		rows[i] = store.OutboxMessage{ID: m.ID, Destination: m.Destination, PartitionKey: m.PartitionKey, Body: body}
	}
	return o.st.WriteMessages(ctx, rows)
}

// check refuses what some broker or the table would refuse for good, and
// so hold back the message's partition: a destination of 1 to 255 bytes of
// printable UTF-8 without spaces; an ID or PartitionKey you set of 1 to 255
// bytes of printable UTF-8 (AMQP's bound on a message-id; the table's text);
// header names of 1 to 128 bytes of visible ASCII but ':' (NATS's and AMQP's
// bounds), none that NATS reserves ("Nats-...") or the id's own
// ("message-id"); values of UTF-8 without line breaks (NATS headers are
// lines).
func check(m Message) error {
	if !printable(m.Destination, false) {
		return errors.New("a destination must be 1 to 255 bytes of printable UTF-8, without spaces")
	}
	if m.ID != "" && !printable(m.ID, true) || m.PartitionKey != "" && !printable(m.PartitionKey, true) {
		return errors.New("an ID or a PartitionKey must be 1 to 255 bytes of printable UTF-8")
	}
	for k, v := range m.Headers {
		if k == "" || len(k) > 128 || strings.IndexFunc(k, func(r rune) bool { return r <= ' ' || r > '~' || r == ':' }) >= 0 {
			return errors.New("a header's name must be 1 to 128 bytes of visible ASCII, without ':'")
		}
		if l := strings.ToLower(k); strings.HasPrefix(l, "nats-") || l == "message-id" {
			return errors.New("a header's name must not be one that NATS reserves (Nats-...) or the message id's own (message-id)")
		}
		if !utf8.ValidString(v) || strings.ContainsAny(v, "\r\n") {
			return errors.New("a header's value must be UTF-8, without line breaks")
		}
	}
	return nil
}

// printable reports whether s is 1 to 255 bytes of printable UTF-8, with
// spaces if spaces is true.
func printable(s string, spaces bool) bool {
	return s != "" && len(s) <= 255 && utf8.ValidString(s) &&
		strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) || !spaces && unicode.IsSpace(r) }) < 0
}

// messageKey is the key a message's body is sealed under, so that it opens
// only as its own id's, to its own destination and partition. Stored
// messages depend on it: it never changes.
func messageKey(m Message) store.Key {
	return sha256.Sum256(store.AppendParts(make([]byte, 0, 64+len(m.ID)+len(m.Destination)+len(m.PartitionKey)),
		"idemkey outbox message v1", m.ID, m.Destination, m.PartitionKey))
}

// bodyVersion starts an unsealed body; no sealed one starts with it.
const bodyVersion = 0x01

// encode is a message's body: its version, the number of headers, each
// name and value length-prefixed in name order, then the payload.
func encode(m Message) []byte {
	n := 1 + binary.MaxVarintLen64 + len(m.Payload)
	for k, v := range m.Headers {
		n += 2*binary.MaxVarintLen64 + len(k) + len(v)
	}
	b := append(make([]byte, 0, n), bodyVersion)
	b = binary.AppendUvarint(b, uint64(len(m.Headers)))
	for _, k := range slices.Sorted(maps.Keys(m.Headers)) {
		b = binary.AppendUvarint(b, uint64(len(k)))
		b = append(b, k...)
		b = binary.AppendUvarint(b, uint64(len(m.Headers[k])))
		b = append(b, m.Headers[k]...)
	}
	return append(b, m.Payload...)
}

var errBody = errors.New("idemkey outbox: a message's body does not decode")

// decode reads encode's body into m's Headers and Payload.
func decode(b []byte, m *Message) error {
	if len(b) == 0 || b[0] != bodyVersion {
		return errBody
	}
	b = b[1:]
	count, n := binary.Uvarint(b)
	if n <= 0 || count > uint64(len(b)) {
		return errBody
	}
	b = b[n:]
	next := func() (string, bool) {
		l, n := binary.Uvarint(b)
		if n <= 0 || l > uint64(len(b)-n) {
			return "", false
		}
		s := string(b[n : n+int(l)])
		b = b[n+int(l):]
		return s, true
	}
	if count > 0 {
		m.Headers = make(map[string]string, count)
	}
	for range count {
		k, ok := next()
		if !ok {
			return errBody
		}
		v, ok := next()
		if !ok {
			return errBody
		}
		m.Headers[k] = v
	}
	m.Payload = b
	return nil
}
