package store

import (
	"context"
	"time"
)

// OutboxMessage is a message a handler published through an outbox (package
// outbox), as an Outbox store keeps it until a relay has sent it.
type OutboxMessage struct {
	ID           string // unique: a second message of an ID is dropped where it is written
	Destination  string
	PartitionKey string // a partition's messages are claimed one after another, in the order written
	Body         []byte // the message's headers and payload as package outbox encodes and seals them
	Created      time.Time
	Attempts     int // how many times the message has been claimed, this claim included
}

// Outbox is a store that keeps an outbox: messages that a handler's
// transaction wrote, for a relay to send once the transaction has
// committed. Several relays may claim at once: a claim is a lease, and a
// message whose lease ended is claimed again, so a message is sent at
// least once and, while its relay lives and answers within its lease, by
// that relay alone.
type Outbox interface {
	// WriteMessages writes ms in the transaction ctx carries, of the
	// store's own kind (store/postgres: an atomic call's, or one given with
	// postgres.ContextWithTx), so that they exist if and only if it
	// commits; without one it returns an error, writing nothing. A message
	// whose ID the outbox holds is dropped.
	WriteMessages(ctx context.Context, ms []OutboxMessage) error
	// ClaimMessages leases up to max unsent messages whose time has come,
	// for lease, and returns them in the order they were written: at most
	// one of each PartitionKey, the partition's oldest unsent one, so that
	// its next is claimed only once it is sent.
	ClaimMessages(ctx context.Context, max int, lease time.Duration) ([]OutboxMessage, error)
	// MarkSent records the messages ids sent (a broker confirmed them): they
	// are never claimed again, and SweepSent deletes them after a retention.
	MarkSent(ctx context.Context, ids []string) error
	// RetryMessages makes the unsent messages ms claimable after delay
	// (ending their lease, or extending it), each only if it has not been
	// claimed since ms were (its ID and Attempts): a relay that answers
	// after its lease ended must not cut another's claim short.
	RetryMessages(ctx context.Context, ms []OutboxMessage, delay time.Duration) error
	// SweepSent deletes up to limit messages sent longer than retention
	// ago, and returns how many it deleted.
	SweepSent(ctx context.Context, retention time.Duration, limit int) (int64, error)
	// PendingMessages counts the unsent messages, and tells how long ago
	// the oldest was written, on the store's clock (0 if none).
	PendingMessages(ctx context.Context) (n int64, oldest time.Duration, err error)
	// ListenMessages calls wake whenever a transaction that wrote messages
	// may have committed, until ctx ends (it then returns nil) or it fails.
	// wake must not block.
	ListenMessages(ctx context.Context, wake func()) error
}
