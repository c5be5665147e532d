// Package reliability is idemkey's fault-injection harness; it has tests
// only. TestFaults runs the example payment server as separate processes, in
// atomic and in two-phase mode, on a PostgreSQL cluster of its own, under many
// concurrent clients that retry, duplicate and give up on calls, while it
// injects faults: a server killed with SIGKILL, server sessions terminated in
// a reservation and in a record, PostgreSQL crashed and stopped, rows locked
// past statement_timeout. Then it checks what the clients received against
// what the database holds. TestFailover runs both modes on a primary and a
// standby, synchronous and then asynchronous, kills the primary under load
// and promotes the standby, and counts the recorded replies lost.
// RELIABILITY.md describes each fault and the checks.
//
//	go test ./reliability                          # each fault once, one failover per topology (make test)
//	go test ./reliability -soak=10m -timeout=0     # random faults for 10 minutes per mode (make soak)
//	go test ./reliability -run '^TestFailover$' -failovers=10 -timeout=0 # (make failover-soak)
package reliability
