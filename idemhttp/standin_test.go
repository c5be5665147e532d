package idemhttp

import (
	"net/http/httptest"
	"testing"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// The 500 that takes the place of an unrecordable response must itself fit
// where a store with bounds promises room after refusing a record.
func TestStandInFitsSmallOutcome(t *testing.T) {
	m := &middleware{eng: engine.New(memory.New()), opts: newOptions(nil)}
	for _, detail := range []string{detailTooLarge, detailStoreFull} {
		_, outcome, err := m.standIn(httptest.NewRecorder(), detail)
		if err != nil {
			t.Fatal(err)
		}
		if len(outcome) > store.SmallOutcome {
			t.Errorf("the stand-in for %q records %d bytes, more than store.SmallOutcome (%d)", detail, len(outcome), store.SmallOutcome)
		}
	}
}
