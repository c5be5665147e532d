package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// maxShown is the longest step result inspect shows; a longer one is
// shown by its size only.
const maxShown = 4 << 10

// stepView is a recorded step as inspect and resolve-step print it.
type stepView struct {
	Name        string    `json:"name"`
	State       string    `json:"state"`               // started (its outcome unknown) or done
	Started     time.Time `json:"started_at,omitzero"` // none on Spanner, which keeps no start time
	Expires     time.Time `json:"expires_at"`
	Fingerprint string    `json:"fingerprint"`
	Bytes       int       `json:"bytes"`                 // the result's size as recorded, sealed or not
	SealedWith  string    `json:"sealed_with,omitempty"` // the key id of a sealed result
	// Result is the result (the JSON of the step's value), opened if
	// sealed, when it is printable text of at most maxShown bytes.
	Result string `json:"result,omitempty"`
	Error  string `json:"error,omitempty"` // why a sealed result is not shown
	now    time.Time
}

func newStepView(key store.Key, st *postgres.StepRecord, keys opener) stepView {
	v := stepView{
		Name:        st.Name,
		State:       "started",
		Started:     st.Started.UTC(),
		Expires:     st.Expires.UTC(),
		Fingerprint: hex.EncodeToString(st.Fingerprint[:8]),
		now:         st.Now.UTC(),
	}
	if !st.Done {
		return v
	}
	v.State, v.Bytes = "done", len(st.Result)
	raw := st.Result
	if id, sealed := seal.SealedWith(raw); sealed {
		v.SealedWith = id
		if keys == nil {
			v.Error = "sealed: give -seal-key to read it"
			return v
		}
		opened, err := keys.Open(store.StepKey(key, st.Name), raw)
		if err != nil {
			v.Error = err.Error()
			return v
		}
		raw = opened
	}
	if printable(raw) {
		v.Result = string(raw)
	}
	return v
}

// printable reports whether a result may be shown as it is: UTF-8 text of
// printable characters, short enough.
func printable(b []byte) bool {
	if len(b) > maxShown || !utf8.Valid(b) {
		return false
	}
	for _, r := range string(b) {
		if !strconv.IsPrint(r) {
			return false
		}
	}
	return true
}

// printSteps prints the steps of a key, after its record, or why there
// are none.
func printSteps(tw io.Writer, steps []stepView, why string) {
	if why != "" {
		fmt.Fprintf(tw, "steps\tnone: %s\n", why)
		return
	}
	if len(steps) == 0 {
		fmt.Fprintf(tw, "steps\tnone\n")
		return
	}
	for _, s := range steps {
		fmt.Fprintf(tw, "step %s\t%s\n", s.Name, describeStep(&s))
	}
}

func describeStep(s *stepView) string {
	if s.State == "started" && s.Started.IsZero() { // on Spanner
		return fmt.Sprintf("started, not finished: its outcome is unknown; expires %s", when(s.Expires, s.now))
	}
	if s.State == "started" {
		return fmt.Sprintf("started %s, not finished: its outcome is unknown (resolve-step); expires %s", when(s.Started, s.now), when(s.Expires, s.now))
	}
	out := fmt.Sprintf("done, result of %d bytes", s.Bytes)
	if s.SealedWith != "" {
		out += fmt.Sprintf(" (sealed with key %s)", s.SealedWith)
	}
	switch {
	case s.Error != "":
		out += ": " + s.Error
	case s.Result != "":
		out += ": " + s.Result
	default:
		out += ": not shown (not printable, or longer than " + strconv.Itoa(maxShown) + " bytes)"
	}
	return out
}

// steps reads the unexpired steps of key.
func (e *env) steps(ctx context.Context, key store.Key, keys opener) ([]stepView, error) {
	steps, err := e.db.steps(ctx, key)
	if err != nil {
		return nil, err
	}
	views := make([]stepView, len(steps))
	for i := range steps {
		views[i] = newStepView(key, &steps[i], keys)
	}
	return views, nil
}

// inspection is inspect's result: the record, if the key has one, and its
// steps, which outlive its release.
type inspection struct {
	Hash    string     `json:"hash"`
	Scope   string     `json:"scope"`
	*view              // nil if the key has no record
	Steps   []stepView `json:"steps"` // null on a table not migrated to steps
	noSteps string     // why there are no steps: their table is missing
}

// findKey reads what r names: the key and its record (nil if it has none,
// which only a whole hash or a scope may name).
func (e *env) findKey(ctx context.Context, r keyRange) (store.Key, *postgres.Record, error) {
	rec, err := e.find(ctx, r)
	var ce *cmdError
	switch {
	case err == nil:
		return rec.Key, rec, nil
	case r.exact && errors.As(err, &ce) && ce.code == exitNotFound:
		return store.Key(r.lo), nil, nil
	}
	return store.Key{}, nil, err
}

// resolved is resolve-step's result.
type resolved struct {
	Hash       string `json:"hash"`
	Scope      string `json:"scope"`
	Step       string `json:"step"`
	Done       bool   `json:"done"`  // the result was recorded; else the step was deleted
	Bytes      int    `json:"bytes"` // the result's, as recorded
	SealedWith string `json:"sealed_with,omitempty"`
}

func resolveStepCommand() command {
	var (
		sel           selector
		name, result  string
		done, notDone bool
	)
	return command{
		flags: func(fs *flag.FlagSet) {
			sel.register(fs)
			fs.StringVar(&name, "step", "", "the step's name, as the handler names it")
			fs.Func("done", "the step took effect, with this result: its value's JSON, as the handler's step returns it", func(s string) error {
				result, done = s, true
				return nil
			})
			fs.BoolVar(&notDone, "not-done", false, "the step did not take effect: delete it, so that the key's next run runs it")
		},
		postgresOnly: "resolve-step works on PostgreSQL only: store/spanner has no ResolveStep (there a started step's outcome is told by its reconcile function, or stays unknown until the step expires)",
		exec: func(ctx context.Context, e *env) (any, error) {
			r, err := sel.resolve(e.visited)
			if err != nil {
				return nil, err
			}
			switch {
			case name == "":
				return nil, usageError("name the step with -step")
			case done == notDone:
				return nil, usageError("give -done RESULT_JSON (the step took effect) or -not-done (it did not), one of them")
			case done && !json.Valid([]byte(result)):
				return nil, usageError("-done wants the step's result as JSON, such as '\"ch_1\"' or '{\"id\":\"ch_1\"}': the engine decodes it into the step's value")
			case e.visited["seal-previous-key"] && !e.visited["seal-key"]:
				return nil, usageError("-seal-previous-key needs -seal-key: the key that seals the result")
			}
			keys, err := sel.ring()
			if err != nil {
				return nil, err
			}
			key, rec, err := e.findKey(ctx, r)
			if err != nil {
				return nil, err
			}
			steps, err := e.steps(ctx, key, keys)
			if err != nil {
				return nil, err
			}
			if err := needsSeal(done && keys == nil, rec, steps); err != nil {
				return nil, err
			}
			res := &resolved{Hash: hex.EncodeToString(key[:]), Scope: key.String(), Step: name, Done: done}
			var raw []byte
			if done {
				raw = []byte(result)
				if ring, ok := keys.(*seal.KeyRing); ok {
					if raw, err = ring.Seal(store.StepKey(key, name), raw); err != nil {
						return nil, err
					}
					res.SealedWith = ring.PrimaryKeyID()
				}
				res.Bytes = len(raw)
			}
			found, err := e.store.ResolveStep(ctx, key, name, done, raw)
			switch {
			case found && err != nil:
				return nil, &cmdError{code: exitRefused, kind: "refused", message: strings.TrimPrefix(err.Error(), "idemkey postgres: resolve step: ")}
			case err != nil:
				return nil, err
			case !found:
				return nil, &cmdError{code: exitNotFound, kind: "not_found", message: fmt.Sprintf("record %s has no step %q (or it expired)", key, name)}
			}
			return res, nil
		},
		human: func(w io.Writer, result any) {
			r := result.(*resolved)
			if !r.Done {
				fmt.Fprintf(w, "step %q of record %s (scope=%s) resolved not done: deleted, so the key's next run runs it\n", r.Step, r.Hash, r.Scope)
				return
			}
			sealed := ""
			if r.SealedWith != "" {
				sealed = ", sealed with key " + r.SealedWith
			}
			fmt.Fprintf(w, "step %q of record %s (scope=%s) resolved done: its result is recorded (%d bytes%s), so the key's next run uses it and does not run the step\n",
				r.Step, r.Hash, r.Scope, r.Bytes, sealed)
		},
	}
}

// needsSeal refuses to record an unsealed result (unsealed true) for a key
// whose record or steps are sealed: the servers seal, and would fail closed
// on a result they cannot open.
func needsSeal(unsealed bool, rec *postgres.Record, steps []stepView) error {
	if !unsealed {
		return nil
	}
	sealed := rec != nil && rec.Outcome != nil && isSealed(rec.Outcome)
	for _, s := range steps {
		sealed = sealed || s.SealedWith != ""
	}
	if sealed {
		return usageError("the key's records are sealed, so the servers seal: give -seal-key, their primary key file, to seal the result")
	}
	return nil
}

func isSealed(raw []byte) bool {
	_, sealed := seal.SealedWith(raw)
	return sealed
}
