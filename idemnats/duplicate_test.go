package idemnats_test

import (
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/idemnats"
)

func TestDuplicateWindowErrorNamesTheFix(t *testing.T) {
	for _, e := range []*idemnats.DuplicateWindowError{
		{Consumer: "charges", Stream: "PAYMENTS", Window: 2 * time.Minute},
		{Consumer: "charges", Stream: "PAYMENTS_MIRROR"}, // a mirror
	} {
		msg := e.Error()
		for _, want := range []string{`consumer "charges"`, "stream " + e.Stream, "Nats-Msg-Id", "unique across tenants",
			"consumer.WithMessageID(idemnats.UniqueMessageID)", "WithMessageID", "cannot be turned off"} {
			if !strings.Contains(msg, want) {
				t.Errorf("%q does not say %q", msg, want)
			}
		}
		if e.Window > 0 && !strings.Contains(msg, "(2m0s)") || e.Window == 0 && !strings.Contains(msg, "mirrors") {
			t.Errorf("%q does not say which window", msg)
		}
	}
}
