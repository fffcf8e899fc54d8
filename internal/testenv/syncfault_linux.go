package testenv

import (
	"errors"
	"runtime"
	"slices"
	"sync"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// SyscallFaults decides the outcome of each call of some system calls of
// this process: a disk whose sync fails (EIO), or whose file system went
// read-only (EROFS), without mounting one. See FailSyscalls.
type SyscallFaults struct {
	mu   sync.Mutex
	next map[int32][]syscall.Errno // by call, the outcomes of its next calls, in order; 0: done as usual
	held map[int32]chan struct{}   // by call, closed as its calls are let go (Hold)
}

// Hold has every call of nr wait, as on a disk that stopped answering
// (a network volume gone), until release is called; then they, and those
// after, are made as usual (or as Next says). Held calls hold their
// threads, not the process: the rest of it runs on.
func (f *SyscallFaults) Hold(nr int) (release func()) {
	ch := make(chan struct{})
	f.mu.Lock()
	f.held[int32(nr)] = ch
	f.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			f.mu.Lock()
			delete(f.held, int32(nr))
			f.mu.Unlock()
			close(ch)
		})
	}
}

// heldBy returns the channel that lets calls of nr go; nil when they are
// not held.
func (f *SyscallFaults) heldBy(nr int32) chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.held[nr]
}

// Next has the next len(errs) calls of nr (unix.SYS_FDATASYNC, say) of
// the process end with errs, in order, without being made (0: made as
// usual); those after are made as usual.
func (f *SyscallFaults) Next(nr int, errs ...syscall.Errno) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.next[int32(nr)] = slices.Clone(errs)
}

// outcome takes the outcome of one call of nr.
func (f *SyscallFaults) outcome(nr int32) syscall.Errno {
	f.mu.Lock()
	defer f.mu.Unlock()
	next := f.next[nr]
	if len(next) == 0 {
		return 0
	}
	f.next[nr] = next[1:]
	return next[0]
}

// again puts back the outcome e of a call of nr that was interrupted and
// is made again.
func (f *SyscallFaults) again(nr int32, e syscall.Errno) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.next[nr] = append([]syscall.Errno{e}, f.next[nr]...)
}

// seccompNotif and seccompNotifResp are the kernel's struct seccomp_notif
// and struct seccomp_notif_resp (linux/seccomp.h).
type seccompNotif struct {
	id    uint64
	pid   uint32
	flags uint32
	nr    int32
	arch  uint32
	ip    uint64
	args  [6]uint64
}

type seccompNotifResp struct {
	id    uint64
	val   int64
	error int32
	flags uint32
}

// auditArch is the kernel's name of this architecture for a seccomp
// filter; 0 where FailSyscalls is not written for it.
func auditArch() uint32 {
	switch runtime.GOARCH {
	case "amd64":
		return unix.AUDIT_ARCH_X86_64
	case "arm64":
		return unix.AUDIT_ARCH_AARCH64
	}
	return 0
}

// FailSyscalls hands every call of the system calls nrs of this process,
// on every thread, to the returned SyscallFaults, which has each made as
// usual until told otherwise (Next): a seccomp filter whose notifications
// a goroutine of its own answers (SECCOMP_RET_USER_NOTIF), which needs no
// privilege. The filter cannot be removed, and with its goroutine gone
// every such call would wait for good: call it only in a child process of
// the test, one that ends with the test. It skips the test on a kernel or
// an architecture without what it needs (Linux 5.7).
func FailSyscalls(tb testing.TB, nrs ...int) *SyscallFaults {
	tb.Helper()
	arch := auditArch()
	if arch == 0 {
		tb.Skipf("FailSyscalls has no seccomp filter for %s", runtime.GOARCH)
	}
	k := uint8(len(nrs))
	prog := []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 4}, // seccomp_data.arch
		{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, K: arch, Jt: 0, Jf: k + 1},
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 0}, // seccomp_data.nr
	}
	for i, nr := range nrs {
		prog = append(prog, unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, K: uint32(nr), Jt: k - uint8(i), Jf: 0})
	}
	prog = append(prog,
		unix.SockFilter{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW},
		unix.SockFilter{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_USER_NOTIF},
	)
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	// no_new_privs is the calling thread's, and the filter is installed
	// from it on every thread (TSYNC), which takes it too.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		tb.Skipf("prctl(PR_SET_NO_NEW_PRIVS): %v", err)
	}
	fd, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER,
		unix.SECCOMP_FILTER_FLAG_NEW_LISTENER|unix.SECCOMP_FILTER_FLAG_TSYNC|unix.SECCOMP_FILTER_FLAG_TSYNC_ESRCH,
		uintptr(unsafe.Pointer(&fprog)))
	if errno != 0 {
		tb.Skipf("seccomp with a listener on every thread: %v", errno)
	}
	f := &SyscallFaults{next: make(map[int32][]syscall.Errno), held: make(map[int32]chan struct{})}
	go f.answer(int(fd))
	return f
}

// answer answers the filter's notifications on listener until the
// process ends.
func (f *SyscallFaults) answer(listener int) {
	for {
		var n seccompNotif
		if err := ioctl(listener, unix.SECCOMP_IOCTL_NOTIF_RECV, unsafe.Pointer(&n)); err != nil {
			continue // EINTR; ENOENT: the thread that called went away
		}
		if held := f.heldBy(n.nr); held != nil {
			go func() {
				<-held
				f.respond(listener, n)
			}()
			continue
		}
		f.respond(listener, n)
	}
}

// respond lets the call of notification n be made, or fails it as Next
// says.
func (f *SyscallFaults) respond(listener int, n seccompNotif) {
	r := seccompNotifResp{id: n.id, flags: unix.SECCOMP_USER_NOTIF_FLAG_CONTINUE}
	if e := f.outcome(n.nr); e != 0 {
		r = seccompNotifResp{id: n.id, error: -int32(e)}
	}
	if err := ioctl(listener, unix.SECCOMP_IOCTL_NOTIF_SEND, unsafe.Pointer(&r)); err != nil && r.error != 0 {
		f.again(n.nr, syscall.Errno(-r.error)) // ENOENT: interrupted, it is made again
	}
}

func ioctl(fd int, req uint, arg unsafe.Pointer) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(arg))
	if errno != 0 {
		return errors.New(errno.Error())
	}
	return nil
}
