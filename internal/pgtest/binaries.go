package pgtest

import (
	osexec "os/exec"
	"path/filepath"
	"slices"
	"strconv"
)

// ServerBinary returns the path of one of PostgreSQL's server programs
// (initdb, pg_ctl, createdb, pgbench), found as scripts/with-postgres finds
// them: in the newest /usr/lib/postgresql/<version>/bin (Debian), else on the
// PATH. It returns "" if there is none.
func ServerBinary(name string) string {
	paths, _ := filepath.Glob(filepath.Join("/usr/lib/postgresql/*/bin", name))
	if len(paths) > 0 {
		return slices.MaxFunc(paths, func(a, b string) int { return version(a) - version(b) })
	}
	if p, err := osexec.LookPath(name); err == nil {
		return p
	}
	return ""
}

// version is the major version in /usr/lib/postgresql/<version>/bin/<name>.
func version(path string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(path))))
	return n
}
