// Package gctune sets the garbage collector of both binaries: a target of
// Percent unless GOGC says otherwise, and a soft memory limit of nine
// tenths of the memory limit of the process's cgroup (a container's
// --memory, a systemd unit's MemoryMax) unless GOMEMLIMIT says otherwise.
//
// At Go's default GOGC of 100 the server collected dozens of times a
// second under load (docs/performance.md); at 400 the heap may grow to
// five times the live one. In a container with a memory limit that grew
// past the limit and the kernel killed the process, where the collector,
// told of the limit, collects harder as the heap nears it
// (docs/reliability.md, bug 474). The limit is read from the cgroup by
// github.com/KimMachineGun/automemlimit, which reads both cgroup versions
// as the kernel nests them; AUTOMEMLIMIT gives another fraction, or "off".
package gctune

import (
	"math"
	"os"
	"runtime/debug"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

// Percent is the collector's target unless GOGC says otherwise.
const Percent = 400

// Set sets the collector's target and memory limit. It returns the memory
// limit in bytes, 0 when there is none; an error says why the cgroup's
// could not be read, with the target set all the same.
func Set() (int64, error) {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(Percent)
	}
	limit, err := memlimit.Set()
	if limit == math.MaxInt64 {
		limit = 0
	}
	return limit, err
}
