//go:build race

package main

// raceEnabled builds the command under test with the race detector too,
// when the tests run with it.
const raceEnabled = true
