package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/tests/natstest"
)

// A relay stopped while an hour of charges was made catches up once it
// runs, at the rate it is given (-relay-rate, for a broker's rate limit),
// and its metrics tell the backlog: the oldest unsent message's age, an
// hour when it starts, and the pending count, down to 0 when it is done.
// The charges are made while no relay runs (-relay=false); their messages'
// times are then moved back over the hour before (the test cannot wait an
// hour), and a second process runs the relay alone (-relay-only). The
// rate is read off the stream's own timestamps of the messages it stored.
func TestRelayCatchesUp(t *testing.T) {
	const n, rate = 200, 50
	ns := natstest.Start(t)
	_, js := ns.Connect(t)
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t, schema)
	bin := servertest.Build(t)
	args := []string{"-database-url", pgtest.SchemaURL(schema), "-outbox", ns.URL}
	server := servertest.Start(t, bin, append(args, "-relay=false")...)

	client := paymentsv1.NewPaymentServiceClient(server.Conn)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			c := charge{client: client, prefix: "catch-up-" + schema + "-"}
			for i := int(next.Add(1)) - 1; i < n; i = int(next.Add(1)) - 1 {
				if _, err := c.one(t.Context(), i); err != nil {
					t.Errorf("charge %d: %v", i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	// The hour: the k-th message of n written (n-k)/n of an hour ago.
	if _, err := db.Exec(t.Context(), `UPDATE idempotency_keys_outbox
		SET created_at = now() - interval '1 hour' * (1 - (seq - (SELECT min(seq) FROM idempotency_keys_outbox))::float8 / $1)`, n); err != nil {
		t.Fatal(err)
	}
	if unsent := count(t, db, `SELECT count(*) FROM idempotency_keys_outbox WHERE sent_at IS NULL`); unsent != n {
		t.Fatalf("%d messages unsent before the relay runs, want %d", unsent, n)
	}

	metricsFile := filepath.Join(t.TempDir(), "metrics-addr")
	relay := supervise(t, "relay", "relay running", bin, append(args, "-relay-only", "-relay-rate", fmt.Sprint(rate),
		"-metrics-addr", "127.0.0.1:0", "-metrics-addr-file", metricsFile)...)
	defer relay.stop(t)
	var metricsURL string
	waitFor(t, 30*time.Second, "the relay's metrics address", func() bool {
		b, err := os.ReadFile(metricsFile)
		metricsURL = "http://" + strings.TrimSpace(string(b)) + "/metrics"
		return err == nil && len(b) > 0
	})
	// The gauges are read while it catches up, until it is done.
	var oldestSeen, pendingSeen float64
	waitFor(t, 2*time.Minute, "every message sent", func() bool {
		m := scrapeGauges(t, metricsURL)
		oldestSeen, pendingSeen = max(oldestSeen, m["idemkey_outbox_oldest_age_seconds"]), max(pendingSeen, m["idemkey_outbox_pending"])
		return count(t, db, `SELECT count(*) FROM idempotency_keys_outbox WHERE sent_at IS NULL`) == 0
	})
	// Once caught up, the gauges say so (they are counted at most once a
	// second).
	waitFor(t, 30*time.Second, "the gauges at 0", func() bool {
		m := scrapeGauges(t, metricsURL)
		return m["idemkey_outbox_pending"] == 0 && m["idemkey_outbox_oldest_age_seconds"] == 0
	})
	// It started with nearly all an hour's messages pending, the oldest an
	// hour old: it sends the oldest first, at most 1/10 of the backlog's
	// age a second at this rate.
	if oldestSeen < 1800 || pendingSeen < n/2 {
		t.Errorf("the largest backlog the metrics told: %v messages, the oldest %vs; want most of %d, about an hour", pendingSeen, oldestSeen, n)
	}

	stream, err := js.Stream(t.Context(), streamName("payments.charge.created"))
	if err != nil {
		t.Fatal(err)
	}
	var stamps []time.Time
	for seq := uint64(1); seq <= n; seq++ {
		m, err := stream.GetMsg(t.Context(), seq)
		if err != nil {
			t.Fatalf("message %d: %v", seq, err)
		}
		stamps = append(stamps, m.Time)
	}
	// At most the rate in any second, and a tenth of a second's batch more
	// (a claim's messages go together), with room for the broker storing
	// a delayed batch next to the following one.
	most := 0
	for i := range stamps {
		j := i
		for j < len(stamps) && stamps[j].Sub(stamps[i]) < time.Second {
			j++
		}
		most = max(most, j-i)
	}
	took := stamps[len(stamps)-1].Sub(stamps[0])
	t.Logf("%d messages of an hour sent in %v at -relay-rate %d: at most %d in a second; metrics: %v pending, the oldest %vs",
		n, took.Round(time.Millisecond), rate, most, pendingSeen, oldestSeen)
	if most > rate*3/2 {
		t.Errorf("%d messages in one second, more than -relay-rate %d allows", most, rate)
	}
	if least := time.Duration(float64(n-rate/10) / rate * float64(time.Second)); took < least*9/10 {
		t.Errorf("%d messages took %v at -relay-rate %d, less than %v", n, took, rate, least*9/10)
	}
}

var gaugeLine = regexp.MustCompile(`(?m)^(idemkey_outbox_[a-z_]+?)(?:\{[^}]*\})? ([0-9.e+-]+)$`)

// scrapeGauges reads the idemkey_outbox_ values of a /metrics page.
func scrapeGauges(t *testing.T, url string) map[string]float64 {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Close = true
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		return nil // the relay may be starting: asked again
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	m := map[string]float64{}
	for _, g := range gaugeLine.FindAllStringSubmatch(string(body), -1) {
		v, err := strconv.ParseFloat(g[2], 64)
		if err == nil {
			m[g[1]] = v
		}
	}
	return m
}
