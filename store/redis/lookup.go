package redis

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/idemkey/idemkey/store"
)

var _ store.Looker = (*Store)(nil)

// Lookup implements store.Looker with one read-only script (lookupScript),
// which fails closed on a lost record as Find's does.
func (s *Store) Lookup(ctx context.Context, key store.Key) (store.Entry, []string, bool, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if err := s.admit(ctx, "lookup"); err != nil {
		return store.Entry{}, nil, false, err
	}
	keys, slot := s.stepKeys(key)
	v, err := s.eval(ctx, lookupScript, keys, s.argv(slot))
	if err != nil {
		return store.Entry{}, nil, false, s.translate(ctx, "lookup", err)
	}
	a, ok := v.([]any)
	if !ok || len(a) != 6 {
		return store.Entry{}, nil, false, errors.New("idemkey redis: lookup: the script's reply has an unexpected shape")
	}
	kind, _ := a[0].(int64)
	fp, _ := a[1].(string)
	outcome, _ := a[2].(string)
	left, _ := a[3].(int64)
	expires, _ := a[4].(int64)
	names, _ := a[5].([]any)
	var steps []string
	for _, n := range names {
		if name, ok := n.(string); ok {
			steps = append(steps, name)
		}
	}
	slices.Sort(steps)
	res := store.Entry{Expires: time.UnixMicro(expires)}
	switch kind {
	case 0:
		return store.Entry{}, steps, false, nil
	case 2:
		res.State, res.Outcome = store.Completed, []byte(outcome)
	case 3:
		res.State, res.RetryAfter = store.Held, time.Duration(left)*time.Microsecond // below maxDuration
	default:
		return store.Entry{}, nil, false, errors.New("idemkey redis: lookup: the script's reply has an unexpected shape")
	}
	copy(res.Fingerprint[:], fp)
	return res, steps, true, nil
}
