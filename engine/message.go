package engine

import (
	"context"
	"strconv"

	"github.com/idemkey/idemkey"
)

// NextMessageID returns the id of the next message that the handler whose ctx
// is publishes (package outbox), and the partition key of the call's
// messages: idemkey.DeriveKey of the call's parts and the message's place
// among those the run numbered ("outbox message 1", "outbox message 2", ...),
// and of "outbox messages". Every run of a key numbers its messages anew, so
// a re-run that publishes the same messages in the same order makes the same
// ids, and the outbox keeps the first run's copy. ok is false outside a call
// that holds a key.
func NextMessageID(ctx context.Context) (id, partition string, ok bool) {
	r, ok := ctx.Value(runningKey{}).(*running)
	if !ok {
		return "", "", false
	}
	r.mu.Lock()
	r.sent++
	n := r.sent
	r.mu.Unlock()
	id = idemkey.DeriveKey(r.tenant, r.op.name, r.userKey, "outbox message "+strconv.Itoa(n))
	return id, idemkey.DeriveKey(r.tenant, r.op.name, r.userKey, "outbox messages"), true
}
