// Package signals gives the binaries their shutdown context: the first
// SIGINT or SIGTERM starts a graceful shutdown, and a second one, during
// a slow shutdown, kills the process (Go's default disposition).
package signals

import (
	"context"
	"os"
	"os/signal"
	"syscall"
)

// Context returns a context that is done once SIGINT or SIGTERM arrives,
// and stop, which releases it. The signals go back to Go's default before
// the context is done, so that whatever the shutdown does after it sees
// Done, a second signal kills the process. (signal.NotifyContext with its
// stop in a context.AfterFunc gave them back on a goroutine of their own,
// after the shutdown had begun: a second signal sent as the shutdown was
// logged could be swallowed, and the process waited out its whole
// shutdown; docs/reliability.md, bug 95.)
func Context() (ctx context.Context, stop func()) {
	sigCtx, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	ctx, cancel := context.WithCancel(context.Background())
	release := context.AfterFunc(sigCtx, func() {
		stopSignals()
		cancel()
	})
	return ctx, func() {
		release()
		stopSignals()
		cancel()
	}
}
