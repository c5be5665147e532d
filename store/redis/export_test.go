package redis

import "time"

// WithClockOffset adds offset() to the server's clock in every decision the
// scripts make, so that the conformance suite can move time forward without
// sleeping. The native expiry follows the real clock, later than the logical
// one, so a record never disappears early; the scripts' own checks decide.
func WithClockOffset(offset func() time.Duration) Option {
	return func(o *options) { o.offset = offset }
}
