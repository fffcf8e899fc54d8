//go:build unix

package testenv

import (
	"sync"
	"syscall"
	"testing"
)

// LimitFileSize makes this process's writes past byte n of a file fail
// (RLIMIT_FSIZE; Go ignores SIGXFSZ, so they fail with EFBIG), as a full
// disk fails them, until the returned func lifts the limit (the test's
// cleanup does too). Pipes and sockets are not files: logs and
// connections go on. The limit is the whole process's, so a test that
// sets it must not be parallel (parallel tests run only after it).
func LimitFileSize(tb testing.TB, n int64) (lift func()) {
	tb.Helper()
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_FSIZE, &old); err != nil {
		tb.Fatal(err)
	}
	lim := old
	lim.Cur = uint64(n)
	if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &lim); err != nil {
		tb.Fatal(err)
	}
	var once sync.Once
	lift = func() {
		once.Do(func() {
			if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &old); err != nil {
				tb.Errorf("lifting the file size limit: %v", err)
			}
		})
	}
	tb.Cleanup(lift)
	return lift
}
