package engine

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"

	"github.com/idemkey/idemkey/store"
)

// Sealer encrypts outcomes on their way to the store and decrypts them on
// their way back (WithSealer). *seal.KeyRing implements it; so may a sealer
// that asks a key service. Its methods are safe for concurrent use.
type Sealer interface {
	// Seal returns outcome sealed for the record of key. It must not modify
	// outcome. An error fails the write as a store failure would.
	Seal(key store.Key, outcome []byte) ([]byte, error)
	// Open returns the outcome that Seal sealed for key, and an error for a
	// record it cannot vouch for: sealed for another key, altered, sealed
	// with a key it does not hold, or not sealed at all (unless it accepts
	// such records). The engine never replays a record Open refuses, nor
	// runs its handler again.
	Open(key store.Key, record []byte) ([]byte, error)
	// Overhead is the most bytes Seal adds to an outcome.
	Overhead() int
}

// sealer is the engine's Sealer, or nil (WithSealer counts a nil pointer,
// such as a nil *seal.KeyRing, as none).
func (e *Engine) sealer() Sealer { return e.opts.sealer }

// sealedPrefix starts every sealed record (package seal's envelope), and no
// outcome an entry point encodes (see the package documentation); the key
// id that sealed it follows the version byte after it.
var sealedPrefix = []byte{0x00, 'i', 'k'}

// sealedWith reports whether record is sealed, and the hex of the id of the
// key that sealed it, for the log.
func sealedWith(record []byte) (keyID string, sealed bool) {
	if !bytes.HasPrefix(record, sealedPrefix) {
		return "", false
	}
	if id := record[len(sealedPrefix):]; len(id) >= 5 {
		return hex.EncodeToString(id[1:5]), true
	}
	return "00000000", true
}

// sealOutcome is what the store records of outcome for key.
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

// opened is res with its outcome opened, for a completed record of key whose
// fingerprint is fp (a record whose fingerprint differs is answered "reused"
// and its outcome never read, so it is left as it is). A record that does
// not open is an error (errUnopened), and so is a sealed one read by an
// engine without a sealer.
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

// roomFor is r with room for a sealed outcome: a store with bounds sets
// MaxOutcome aside, and the sealed outcome is larger than the engine's bound.
func (e *Engine) roomFor(r store.Reservation) store.Reservation {
	if s := e.sealer(); s != nil && r.MaxOutcome > 0 {
		r.MaxOutcome += s.Overhead()
	}
	return r
}

// sealingTx seals the outcome an atomic call commits, for the key its
// reservation holds.
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
