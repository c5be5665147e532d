package engine

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"

	"github.com/idemkey/idemkey/store"
)

// Sealer encrypts outcomes on their way to the store and decrypts them on
// their way back (WithSealer): *seal.KeyRing, or a sealer that asks a key
// service. Its methods are safe for concurrent use.
type Sealer interface {
	// Seal must not modify outcome; an error fails the write as a store
	// failure would.
	Seal(key store.Key, outcome []byte) ([]byte, error)
	// Open returns the outcome Seal sealed for key, or an error for a record
	// it cannot vouch for (another key's, altered, an unknown key, not
	// sealed). The engine never replays a record Open refuses, nor runs its
	// handler again.
	Open(key store.Key, record []byte) ([]byte, error)
	// Overhead is the most bytes Seal adds to an outcome.
	Overhead() int
}

// sealer is nil without one (WithSealer counts a nil *seal.KeyRing as none).
func (e *Engine) sealer() Sealer { return e.opts.sealer }

// sealedPrefix starts every sealed record, and no outcome an entry point
// encodes; the version byte and the key id follow it.
var sealedPrefix = []byte{0x00, 'i', 'k'}

// sealedWith returns, for the log, the hex id of the key that sealed record.
func sealedWith(record []byte) (keyID string, sealed bool) {
	if !bytes.HasPrefix(record, sealedPrefix) {
		return "", false
	}
	if id := record[len(sealedPrefix):]; len(id) >= 5 {
		return hex.EncodeToString(id[1:5]), true
	}
	return "00000000", true
}

func (e *Engine) sealOutcome(key store.Key, outcome []byte) ([]byte, error) {
	s := e.sealer()
	if s == nil {
		return outcome, nil
	}
	sealed, err := s.Seal(key, outcome)
	if err != nil {
		return nil, fmt.Errorf("idemkey: the outcome could not be sealed: %w", err)
	}
	return sealed, nil
}

// opened opens the outcome of a completed record whose fingerprint is fp (a
// record of another fingerprint is answered Reused, never read). A record
// that does not open is errUnopened, as is a sealed one without a sealer.
func (e *Engine) opened(key store.Key, fp *store.Fingerprint, res store.Entry) (store.Entry, error) {
	if res.State != store.Completed || (fp != nil && res.Fingerprint != *fp) {
		return res, nil
	}
	s := e.sealer()
	if s == nil {
		if id, sealed := sealedWith(res.Outcome); sealed {
			return store.Entry{}, unopened(fmt.Errorf("the record is sealed (key id %s), and this engine has no sealer (WithSealer)", id))
		}
		return res, nil
	}
	outcome, err := s.Open(key, res.Outcome)
	if err != nil {
		return store.Entry{}, unopened(err)
	}
	res.Outcome = outcome
	return res, nil
}

// roomFor counts the sealer's overhead in the room a store with bounds sets
// aside.
func (e *Engine) roomFor(r store.Reservation) store.Reservation {
	if s := e.sealer(); s != nil && r.MaxOutcome > 0 {
		r.MaxOutcome += s.Overhead()
	}
	return r
}

// sealingTx seals the outcome an atomic call commits.
type sealingTx struct {
	store.Tx
	e   *Engine
	key store.Key
}

func (t sealingTx) Commit(ctx context.Context, outcome []byte, keepWrites bool) error {
	sealed, err := t.e.sealOutcome(t.key, outcome)
	if err != nil {
		// Nothing may commit: the contract of a failed Commit.
		_ = t.Tx.Rollback(ctx)
		return err
	}
	return t.Tx.Commit(ctx, sealed, keepWrites)
}
