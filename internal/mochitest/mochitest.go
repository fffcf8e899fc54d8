// Package mochitest is what tests that run a bare mochi-mqtt broker (a
// listeners.TCP, hooks of their own) share.
package mochitest

import (
	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// Close stops srv as its Close does, without the deadlock in mochi
// v2.7.9's Close (mochi-mqtt/server#488): Clients.GetByListener takes the
// clients' read lock twice (it calls Len under it), so a client whose
// connection ends at that moment (taking the write lock in between)
// blocks both for good, and the test hangs until its timeout. Here each
// listener's clients are read under one read lock and disconnected before
// mochi's Close runs; a listener closes its clients only once, so mochi's
// own closing then has nothing left to do. (broker/embedded, the
// product's broker, has a listener of its own for the same reason.)
func Close(srv *mochi.Server) error {
	srv.Listeners.CloseAll(func(listener string) {
		for _, cl := range srv.Clients.GetAll() {
			if cl.Net.Listener == listener && !cl.Closed() {
				_ = srv.DisconnectClient(cl, packets.ErrServerShuttingDown)
			}
		}
	})
	return srv.Close()
}
