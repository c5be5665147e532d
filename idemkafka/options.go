package idemkafka

// defaultMaxAttempts is how many times a record that fails for now is
// processed before it is dead-lettered (WithMaxAttempts).
const defaultMaxAttempts = 5

// Option configures New's Broker.
type Option func(*broker)

// WithMaxAttempts sets how many times a record that fails for now (the
// handler's transient error, the store failing, its id in progress
// elsewhere) is processed, each after the consumer's backoff
// (consumer.WithBackoff), before its last attempt dead-letters it (5 by
// default). Values below 1 keep the default.
func WithMaxAttempts(n int) Option {
	return func(b *broker) {
		if n >= 1 {
			b.maxAttempts = n
		}
	}
}
