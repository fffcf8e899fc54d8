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
// connections go on.
//
// The limit is the whole process's, the test binary's own files included:
// the test log go test asks for when it may cache the result
// (-test.testlogfile), written through a buffer that keeps the first
// error, ended the binary "testing: can't write testlog.txt: file too
// large" after every test passed, when the buffer was flushed while a
// limit held (bug 448); a coverage profile, or another test's file, fails
// the same way. So LimitFileSize runs only in a child process of the test
// (InChild), and fails the test anywhere else.
func LimitFileSize(tb testing.TB, n int64) (lift func()) {
	tb.Helper()
	if !isChild(tb) {
		tb.Fatalf("LimitFileSize limits the whole test binary's files: call it only after testenv.InChild(t) (bug 448)")
	}
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
