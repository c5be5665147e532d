package main

import (
	"context"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// selector is how inspect and forget name a record, and the keys that open
// its outcome if it is sealed.
type selector struct {
	tenant, method, key string
	hash                string

	sealKey      string   // -seal-key
	previousKeys []string // -seal-previous-key
}

// ring reads the key files given, if any: the key ring that opens sealed
// outcomes, or nil.
func (s *selector) ring() (opener, error) {
	paths := s.previousKeys
	if s.sealKey != "" {
		paths = append([]string{s.sealKey}, paths...)
	}
	if len(paths) == 0 {
		return nil, nil
	}
	keys, err := readKeys(paths)
	if err != nil {
		return nil, err
	}
	// Any key opens; the CLI never seals.
	r, err := seal.NewKeyRing(keys[0], seal.WithPreviousKeys(keys[1:]...))
	if err != nil {
		return nil, usageError("%s", strings.TrimPrefix(err.Error(), "idemkey/seal: "))
	}
	return r, nil
}

// readKeys reads the key files at paths (seal.ReadKeyFile).
func readKeys(paths []string) ([][]byte, error) {
	keys := make([][]byte, len(paths))
	for i, p := range paths {
		k, err := seal.ReadKeyFile(p)
		if err != nil {
			return nil, usageError("%s", strings.TrimPrefix(err.Error(), "idemkey/seal: "))
		}
		keys[i] = k
	}
	return keys, nil
}

func (s *selector) register(fs *flag.FlagSet) {
	fs.StringVar(&s.sealKey, "seal-key", "", "a key file of the servers' key ring (seal.ReadKeyFile), to show a sealed outcome")
	fs.Func("seal-previous-key", "another key file of the ring, for records sealed before a rotation (repeatable)", func(path string) error {
		s.previousKeys = append(s.previousKeys, path)
		return nil
	})
	fs.StringVar(&s.tenant, "tenant", "", "the tenant, as the server's TenantFunc returns it")
	fs.StringVar(&s.method, "method", "", `the full method, such as /pkg.Service/Method; "" for a key scoped to its tenant only (engine.ScopeTenant)`)
	fs.StringVar(&s.key, "key", "", "the idempotency key")
	fs.StringVar(&s.hash, "hash", "", "instead of -tenant, -method and -key: the record's hash in hex, or a prefix of it such as the scope= of a log line")
}

// keyRange is the set of record keys a selector names: one key, or those
// from lo up to, not including, hi (nil: no upper bound).
type keyRange struct {
	lo, hi []byte
	exact  bool
}

func (s *selector) resolve(visited map[string]bool) (keyRange, error) {
	scoped := visited["tenant"] || visited["method"] || visited["key"]
	if visited["hash"] {
		if scoped {
			return keyRange{}, usageError("give either -hash or -tenant, -method and -key, not both")
		}
		return hashRange(s.hash)
	}
	if !visited["tenant"] || !visited["method"] || !visited["key"] {
		return keyRange{}, usageError(`name the record with -tenant, -method and -key (-tenant "" and -method "" when empty), or with -hash`)
	}
	if s.method != "" && !strings.HasPrefix(s.method, "/") {
		return keyRange{}, usageError(`-method must be a full method name such as /example.payments.v1.PaymentService/CreateCharge, or "" for a key scoped to its tenant only`)
	}
	if err := idemkey.ValidateKey(s.key); err != nil {
		return keyRange{}, usageError("-key is not a valid idempotency key (1 to %d bytes of visible ASCII), so no record can have it", idemkey.MaxKeyLen)
	}
	k := store.ScopeKey(s.tenant, s.method, s.key)
	return keyRange{lo: k[:], exact: true}, nil
}

// hashRange reads a hash or a prefix of one: the keys that start with its hex
// digits, even an odd number of them.
func hashRange(h string) (keyRange, error) {
	h = strings.ToLower(h)
	if h == "" || len(h) > 2*len(store.Key{}) || strings.Trim(h, "0123456789abcdef") != "" {
		return keyRange{}, usageError("-hash wants 1 to 64 hex digits")
	}
	if len(h) == 2*len(store.Key{}) {
		lo, _ := hex.DecodeString(h)
		return keyRange{lo: lo, exact: true}, nil
	}
	// hi is the prefix plus one in its last digit, carrying; all f's have none.
	next := []byte(h)
	i := len(next) - 1
	for ; i >= 0 && next[i] == 'f'; i-- {
		next[i] = '0'
	}
	var r keyRange
	if i >= 0 {
		next[i] = "0123456789abcdef"[strings.IndexByte("0123456789abcdef", next[i])+1]
		r.hi = mustHex(string(next))
	}
	r.lo = mustHex(h)
	return r, nil
}

// mustHex decodes hex digits, padded with a 0 to whole bytes.
func mustHex(digits string) []byte {
	if len(digits)%2 == 1 {
		digits += "0"
	}
	b, err := hex.DecodeString(digits)
	if err != nil {
		panic(err) // checked by hashRange
	}
	return b
}

// leaseLive reports whether the record is in progress under a lease that has
// not ended: a call may still be running it.
func leaseLive(r *postgres.Record) bool { return r.State == "in_progress" && r.LeaseEnd.After(r.Now) }

// expired reports whether the store counts the record as absent, as its
// Sweep does: its retention has passed and it holds no live lease.
func expired(r *postgres.Record) bool {
	return !r.Expires.After(r.Now) && (r.State == "completed" || !r.LeaseEnd.After(r.Now))
}

// match is one record a hash prefix matched, for the list of an ambiguous one.
type match struct {
	Hash    string    `json:"hash"`
	State   string    `json:"state"`
	Created time.Time `json:"created_at"`
}

// maxMatches is how many records of an ambiguous prefix are listed.
const maxMatches = 20

// find reads the one record r names.
func (e *env) find(ctx context.Context, r keyRange) (*postgres.Record, error) {
	hi := r.hi
	if r.exact {
		hi = append(r.lo[:len(r.lo):len(r.lo)], 0) // the next key after r.lo
	}
	recs, err := e.db.records(ctx, r.lo, hi, maxMatches+1)
	switch {
	case err != nil:
		return nil, err
	case len(recs) == 0:
		return nil, &cmdError{code: exitNotFound, kind: "not_found", message: "no such record"}
	case len(recs) > 1:
		ce := &cmdError{code: exitUsage, kind: "ambiguous"}
		for _, rec := range recs[:min(len(recs), maxMatches)] {
			ce.matches = append(ce.matches, match{hex.EncodeToString(rec.Key[:]), rec.State, rec.Created})
		}
		more := ""
		if len(recs) > maxMatches {
			more = "more than "
		}
		ce.message = fmt.Sprintf("hash prefix %s matches %s%d records: give more of the hash", hex.EncodeToString(r.lo), more, len(ce.matches))
		return nil, ce
	}
	return &recs[0], nil
}

// view is a record as inspect and forget print it.
type view struct {
	Hash        string    `json:"hash"`
	Scope       string    `json:"scope"` // the prefix log lines show
	State       string    `json:"state"`
	Token       int64     `json:"token"`
	Created     time.Time `json:"created_at"`
	LeaseEnd    time.Time `json:"lease_end"`
	LeaseLive   bool      `json:"lease_live"`
	Expires     time.Time `json:"expires_at"`
	Expired     bool      `json:"expired"`
	Now         time.Time `json:"now"` // the database's
	Fingerprint string    `json:"fingerprint"`
	Outcome     *outcome  `json:"outcome"` // nil in progress
}

// opener opens sealed outcomes: a *seal.KeyRing, or nil.
type opener interface {
	Open(key store.Key, record []byte) ([]byte, error)
}

// outcome is a recorded outcome, decoded without the response's type, which
// the record does not hold.
type outcome struct {
	Kind       string   `json:"kind"` // response, status, http, sealed (no key given to open it), or unreadable
	Bytes      int      `json:"bytes"`
	SealedWith string   `json:"sealed_with,omitempty"` // the key id of a sealed outcome
	Code       string   `json:"code,omitempty"`
	CodeNumber int32    `json:"code_number,omitempty"`
	Message    string   `json:"message,omitempty"`
	Details    []string `json:"details,omitempty"` // type URLs
	Status     int32    `json:"status,omitempty"`  // an HTTP response's
	Header     []string `json:"header"`            // metadata names; values are never shown
	Trailer    []string `json:"trailer"`
	Error      string   `json:"error,omitempty"` // why it is unreadable
}

func newView(r *postgres.Record, keys opener) *view {
	v := &view{
		Hash:        hex.EncodeToString(r.Key[:]),
		Scope:       r.Key.String(),
		State:       r.State,
		Token:       r.Token,
		Created:     r.Created.UTC(),
		LeaseEnd:    r.LeaseEnd.UTC(),
		LeaseLive:   leaseLive(r),
		Expires:     r.Expires.UTC(),
		Expired:     expired(r),
		Now:         r.Now.UTC(),
		Fingerprint: hex.EncodeToString(r.Fingerprint[:min(len(r.Fingerprint), 8)]),
	}
	if r.Outcome != nil {
		v.Outcome = readOutcome(r.Key, r.Outcome, keys)
	}
	return v
}

// readOutcome reads a recorded outcome, sealed or not. A sealed one is
// opened with keys, if given; else only its size and key id are shown.
func readOutcome(key store.Key, raw []byte, keys opener) *outcome {
	id, sealed := seal.SealedWith(raw)
	if !sealed {
		return decodeOutcome(raw)
	}
	if keys == nil {
		return &outcome{Kind: "sealed", Bytes: len(raw), SealedWith: id, Header: []string{}, Trailer: []string{}}
	}
	opened, err := keys.Open(key, raw)
	if err != nil {
		return &outcome{Kind: "unreadable", Bytes: len(raw), SealedWith: id, Error: err.Error(), Header: []string{}, Trailer: []string{}}
	}
	o := decodeOutcome(opened)
	o.SealedWith = id
	return o
}

// decodeOutcome reads an idemkey.v1.Outcome as the interceptor wrote it.
func decodeOutcome(raw []byte) *outcome {
	o := &outcome{Header: []string{}, Trailer: []string{}}
	var out idemkeyv1.Outcome
	if err := proto.Unmarshal(raw, &out); err != nil {
		o.Kind, o.Bytes, o.Error = "unreadable", len(raw), err.Error()
		return o
	}
	for _, m := range out.GetHeader() {
		o.Header = append(o.Header, m.GetKey())
	}
	for _, m := range out.GetTrailer() {
		o.Trailer = append(o.Trailer, m.GetKey())
	}
	switch r := out.GetResult().(type) {
	case *idemkeyv1.Outcome_Response:
		o.Kind, o.Bytes = "response", len(r.Response)
	case *idemkeyv1.Outcome_Http:
		o.Kind, o.Bytes, o.Status = "http", len(r.Http.GetBody()), r.Http.GetStatus()
		for _, m := range r.Http.GetHeader() {
			o.Header = append(o.Header, m.GetKey())
		}
	case *idemkeyv1.Outcome_Status:
		o.Kind, o.Bytes = "status", len(raw)
		o.CodeNumber = r.Status.GetCode()
		o.Code = codes.Code(o.CodeNumber).String()
		o.Message = string(r.Status.GetMessage())
		for _, d := range r.Status.GetDetails() {
			o.Details = append(o.Details, d.GetTypeUrl())
		}
	default:
		o.Kind, o.Bytes, o.Error = "unreadable", len(raw), "neither a response nor a status"
	}
	return o
}

func inspectCommand() command {
	var sel selector
	return command{
		flags: sel.register,
		exec: func(ctx context.Context, e *env) (any, error) {
			r, err := sel.resolve(e.visited)
			if err != nil {
				return nil, err
			}
			keys, err := sel.ring()
			if err != nil {
				return nil, err
			}
			key, rec, err := e.findKey(ctx, r)
			if err != nil {
				return nil, err
			}
			in := &inspection{Hash: hex.EncodeToString(key[:]), Scope: key.String()}
			in.Steps, err = e.steps(ctx, key, keys)
			switch {
			case e.db.missingTable(err): // a table at a schema version before steps
				in.noSteps = fmt.Sprintf("table %s_steps not found (the migration of steps is not applied): %s", e.table, migrateUp(e.table, e.spanner))
			case err != nil:
				return nil, err
			}
			if rec == nil && len(in.Steps) == 0 {
				return nil, &cmdError{code: exitNotFound, kind: "not_found", message: "no such record"}
			}
			if rec != nil {
				in.view = newView(rec, keys)
			}
			return in, nil
		},
		human: func(w io.Writer, result any) {
			in := result.(*inspection)
			tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
			defer tw.Flush()
			if in.view != nil {
				printView(tw, in.view)
			} else {
				fmt.Fprintf(tw, "record\t%s (scope=%s in logs)\n", in.Hash, in.Scope)
				fmt.Fprintf(tw, "state\tnone: released, or never recorded; the steps below outlive it\n")
			}
			printSteps(tw, in.Steps, in.noSteps)
		},
	}
}

func printView(tw io.Writer, v *view) {
	fmt.Fprintf(tw, "record\t%s (scope=%s in logs)\n", v.Hash, v.Scope)
	state := v.State
	switch {
	case v.Expired:
		state += ", expired: counts as absent, and the next sweep deletes it"
	case v.State == "in_progress" && v.LeaseLive:
		state += ", a call holds it"
	case v.State == "in_progress":
		state += ", lease ended: the next call with the same request takes it over"
	}
	fmt.Fprintf(tw, "state\t%s\n", state)
	fmt.Fprintf(tw, "token\t%d\n", v.Token)
	fmt.Fprintf(tw, "created\t%s\n", when(v.Created, v.Now))
	lease := "ended"
	switch {
	case v.State == "completed":
		lease = "not held: the record is completed"
	case v.LeaseLive:
		lease = "live"
	}
	fmt.Fprintf(tw, "lease end\t%s, %s\n", when(v.LeaseEnd, v.Now), lease)
	fmt.Fprintf(tw, "expires\t%s\n", when(v.Expires, v.Now))
	fmt.Fprintf(tw, "fingerprint\t%s…\n", v.Fingerprint)
	o := v.Outcome
	if o == nil {
		fmt.Fprintf(tw, "outcome\tnone yet\n")
		return
	}
	sealedWith := ""
	if o.SealedWith != "" {
		sealedWith = fmt.Sprintf(" (sealed with key %s)", o.SealedWith)
	}
	switch o.Kind {
	case "response":
		fmt.Fprintf(tw, "outcome\tresponse of %d bytes%s\n", o.Bytes, sealedWith)
	case "status":
		fmt.Fprintf(tw, "outcome\terror %s (%d): %s%s\n", o.Code, o.CodeNumber, quoted(o.Message), sealedWith)
		for _, d := range o.Details {
			fmt.Fprintf(tw, "detail\t%s\n", d)
		}
	case "http":
		fmt.Fprintf(tw, "outcome\tHTTP %d, body of %d bytes%s\n", o.Status, o.Bytes, sealedWith)
	case "sealed":
		fmt.Fprintf(tw, "outcome\tsealed with key %s, %d bytes: give -seal-key to read it\n", o.SealedWith, o.Bytes)
		return
	default:
		fmt.Fprintf(tw, "outcome\tunreadable, %d bytes%s: %s\n", o.Bytes, sealedWith, o.Error)
	}
	fmt.Fprintf(tw, "header\t%s\n", names(o.Header))
	fmt.Fprintf(tw, "trailer\t%s\n", names(o.Trailer))
}

// when prints t and how far it is from now.
func when(t, now time.Time) string {
	d := t.Sub(now).Round(time.Second)
	switch {
	case d > 0:
		return fmt.Sprintf("%s (in %s)", t.Format(time.RFC3339), d)
	case d < 0:
		return fmt.Sprintf("%s (%s ago)", t.Format(time.RFC3339), -d)
	}
	return t.Format(time.RFC3339) + " (now)"
}

func quoted(s string) string {
	if utf8.ValidString(s) && !strings.ContainsAny(s, "\n\r\t") {
		return s
	}
	return strconv.Quote(s)
}

func names(ns []string) string {
	if len(ns) == 0 {
		return "none"
	}
	return strings.Join(ns, ", ") + " (values not shown)"
}

// forgotten is forget's result.
type forgotten struct {
	Forgot bool  `json:"forgot"`
	Forced bool  `json:"forced"` // a live in-progress record was deleted
	Record *view `json:"record"` // as it was
}

func forgetCommand() command {
	var (
		sel   selector
		force bool
	)
	return command{
		flags: func(fs *flag.FlagSet) {
			sel.register(fs)
			fs.BoolVar(&force, "force", false, "delete a record in progress under a live lease too")
		},
		exec: func(ctx context.Context, e *env) (any, error) {
			r, err := sel.resolve(e.visited)
			if err != nil {
				return nil, err
			}
			keys, err := sel.ring()
			if err != nil {
				return nil, err
			}
			rec, err := e.find(ctx, r) // a prefix names one record, or none
			if err != nil {
				return nil, err
			}
			return e.forget(ctx, rec.Key, force, keys)
		},
		human: func(w io.Writer, result any) {
			f := result.(*forgotten)
			fmt.Fprintf(w, "forgot record %s (scope=%s, %s): the next call with its key runs the handler again\n",
				f.Record.Hash, f.Record.Scope, f.Record.State)
			if f.Forced {
				fmt.Fprintln(w, "it was in progress under a live lease: the call that held it cannot record its outcome now")
			}
		},
	}
}

// forget deletes the record of key (the store's Forget), unless it is in
// progress under a live lease and not force.
func (e *env) forget(ctx context.Context, key store.Key, force bool, keys opener) (*forgotten, error) {
	rec, deleted, err := e.db.forget(ctx, key, force)
	switch {
	case err != nil:
		return nil, err
	case deleted:
		return &forgotten{Forgot: true, Forced: leaseLive(&rec), Record: newView(&rec, keys)}, nil
	case rec.State == "":
		return nil, &cmdError{code: exitNotFound, kind: "not_found", message: "no such record"}
	}
	return nil, &cmdError{code: exitRefused, kind: "refused", message: fmt.Sprintf(
		"record %s is in progress under a live lease, which ends %s: its call may still be running; wait for the lease to end, or use -force",
		rec.Key, when(rec.LeaseEnd.UTC(), rec.Now))}
}
