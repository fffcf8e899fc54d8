package agent

import (
	"errors"
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
	switch {
	case first:
		h.failing.Store(true)
		h.since, h.logged, h.failed = now, now, 0
		a.log.Error("the spool cannot be written: commands stay unacknowledged with the broker (it sends them again), and final replies wait to be recorded, until it can; free space under --data",
			"spool", a.spoolPath, "write", what, "err", err)
	case again:
		a.log.Error("the spool still cannot be written; free space under --data",
			"spool", a.spoolPath, "for", now.Sub(h.since).Round(time.Second), "failed_writes", h.failed, "write", what, "err", err)
		h.logged, h.failed = now, 0
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
	a.log.Info("the spool is written again", "spool", a.spoolPath, "after", time.Since(h.since).Round(time.Second))
	h.mu.Unlock()
	// The final replies whose write failed are tried again now, not at
	// the outbox loop's next tick.
	signal(a.outboxWake)
}

// noSpace reports whether err is a file system's "no space" (its blocks or
// the user's quota), which deleting files relieves; a file size limit
// (EFBIG) is not.
func noSpace(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)
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
