package idemhttp

import (
	"errors"
	"net/http/httptest"
	"testing"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// The 500 that takes the place of an unrecordable response must itself fit
// where a store with bounds promises room after refusing a record, whatever
// the reason it stands in for.
func TestStandInFitsSmallOutcome(t *testing.T) {
	m := &middleware{opts: newOptions(nil)}
	for _, why := range []error{engine.ErrTooLarge, errResponseTooLarge, store.ErrFull, errors.New("the redaction function left the status 100")} {
		pw, outcome := m.standIn(httptest.NewRecorder(), why)
		if pw.status != 500 {
			t.Errorf("the stand-in for %q has the status %d, want 500", why, pw.status)
		}
		if len(outcome) > store.SmallOutcome {
			t.Errorf("the stand-in for %q records %d bytes, more than store.SmallOutcome (%d)", why, len(outcome), store.SmallOutcome)
		}
	}
}
