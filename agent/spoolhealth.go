package agent

import (
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// spoolLogEvery is how often, at most, the bridge says again that its
// spool still cannot be written.
const spoolLogEvery = time.Minute

// spoolHealth tells the operator when the spool's writes fail (a full
// disk, a file size limit) and when they work again: once as they start
// failing, once a minute while they fail, once as they work again. Every
// path that writes the spool retries on its own (the intake every second,
// each worker marking its command every second, the outbox loop its final
// replies); each logged every failure, an error a second for each, which
// on a full disk is more of what fills it, and none said what to do
// (docs/reliability.md, bug 165).
type spoolHealth struct {
	failing atomic.Bool // read on every write that succeeds

	mu     sync.Mutex
	since  time.Time // when the writes started failing
	logged time.Time // when that was last said
	failed int       // writes failed since it was last said
}

// spoolFailed notes a write of the spool that failed; what says which.
func (a *Agent) spoolFailed(what string, err error) {
	h := &a.spoolHealth
	h.mu.Lock()
	defer h.mu.Unlock()
	now := time.Now()
	h.failed++
	first, again := !h.failing.Load(), now.Sub(h.logged) >= spoolLogEvery
	if (first || again) && noSpace(err) {
		a.makeRoom()
	}
	// What to do: a file size limit is not relieved by freeing space.
	todo := "free space under --data"
	if diskRefusal(err) == syscall.EFBIG {
		todo = spoolSizeLimit
	}
	switch {
	case first:
		h.failing.Store(true)
		h.since, h.logged, h.failed = now, now, 0
		a.spoolObserved(false)
		a.log.Error("the spool cannot be written: commands stay unacknowledged with the broker (it sends them again), and final replies wait to be recorded, until it can; "+todo,
			"spool", a.spoolPath, "write", what, "err", err)
	case again:
		a.log.Error("the spool still cannot be written; "+todo,
			"spool", a.spoolPath, "for", now.Sub(h.since).Round(time.Second), "failed_writes", h.failed, "write", what, "err", err)
		h.logged, h.failed = now, 0
	}
}

// spoolSizeLimit is what to do when a file size limit refuses the spool
// (EFBIG): the disk may have room to spare.
const spoolSizeLimit = "a file size limit refuses it, not the disk: lift the bridge's (ulimit -f; LimitFSIZE= of its systemd unit, or its container's)"

// spoolObserved tells the observer whether the spool takes writes (an
// Agent made without New, as some tests make one, has none).
func (a *Agent) spoolObserved(ok bool) {
	if a.opts.Observer != nil {
		a.opts.Observer.SpoolWritable(ok)
	}
}

// spoolWritten notes a write of the spool that succeeded.
func (a *Agent) spoolWritten() {
	h := &a.spoolHealth
	if !h.failing.Load() {
		return
	}
	h.mu.Lock()
	if !h.failing.Load() {
		h.mu.Unlock()
		return
	}
	h.failing.Store(false)
	a.spoolObserved(true)
	a.log.Info("the spool is written again", "spool", a.spoolPath, "after", time.Since(h.since).Round(time.Second))
	h.mu.Unlock()
	// The final replies whose write failed are tried again now, not at
	// the outbox loop's next tick.
	signal(a.outboxWake)
}

// diskRefusal is the disk's refusal of more data that err is or tells:
// ENOSPC (no space), EDQUOT (the user's quota) or EFBIG (a file size
// limit); 0 for any other error. It is the one test of a full disk for
// every path that writes the bridge's files: the spool's writes and its
// first open, and the blob downloads. bbolt passes the errors of its
// file's growth on as text only (fmt.Errorf with %s: "file resize error",
// "file sync error"), so for those the errno's text is looked for in
// theirs; missed, a spool that could not grow on a disk out of space
// (a file system without sparse files, FAT's) kept the blob cache
// (docs/reliability.md, bug 195).
func diskRefusal(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	refusals := []syscall.Errno{syscall.ENOSPC, syscall.EDQUOT, syscall.EFBIG}
	for _, errno := range refusals {
		if errors.Is(err, errno) {
			return errno
		}
	}
	msg := err.Error()
	if !strings.Contains(msg, "file resize error: ") && !strings.Contains(msg, "file sync error: ") {
		return 0
	}
	for _, errno := range refusals {
		if strings.Contains(msg, errno.Error()) {
			return errno
		}
	}
	return 0
}

// noSpace reports whether err is a file system's "no space" (its blocks or
// the user's quota), which deleting files relieves; a file size limit
// (EFBIG) is not.
func noSpace(err error) bool {
	r := diskRefusal(err)
	return r == syscall.ENOSPC || r == syscall.EDQUOT
}

// makeRoom deletes the blob cache's blobs that no command is using, to
// give the spool the space: a cached blob is downloaded again when a
// command needs it, and a command the spool cannot take in is not run at
// all. The cache, up to --blob-cache-mb (512 MiB by default), is often
// the most a gateway's card holds of the bridge's.
func (a *Agent) makeRoom() {
	if n, freed := a.blobs.trimTo("", 0); n > 0 {
		a.log.Warn("deleted cached blobs to give the spool room", "count", n, "bytes", freed, "dir", a.blobs.dir)
	}
}
