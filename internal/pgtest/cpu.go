package pgtest

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// BackendCPU is the CPU time a process has run, from /proc/PID/schedstat:
// for a backend of a PostgreSQL server on this machine (its pid from
// pg_backend_pid()), what the database itself spent, which no other process
// on a shared machine inflates as it does latency.
func BackendCPU(pid int) (time.Duration, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", pid))
	if err != nil {
		return 0, err
	}
	field, _, _ := strings.Cut(string(bytes.TrimSpace(stat)), " ")
	ns, err := strconv.ParseInt(field, 10, 64)
	return time.Duration(ns), err
}
