package interceptor

import (
	"fmt"
	"time"

	"github.com/idemkey/idemkey"
)

// A client tells idemkey's errors apart by their reason.
func ExampleReason() {
	for _, err := range []error{
		reusedKeyError(),
		inProgressError(500 * time.Millisecond),
		fmt.Errorf("card declined"),
	} {
		switch Reason(err) {
		case idemkey.ReasonKeyReused:
			fmt.Println("bug: one key was used for two different requests")
		case idemkey.ReasonInProgress:
			delay, _ := RetryDelay(err)
			fmt.Println("still running; retry with the same key in", delay)
		default:
			fmt.Println("not an idemkey error:", err)
		}
	}
	// Output:
	// bug: one key was used for two different requests
	// still running; retry with the same key in 500ms
	// not an idemkey error: card declined
}
