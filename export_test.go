package idemkey

// DurationOf is durationOf, for the tests of RetryDelay's saturation.
var DurationOf = durationOf
