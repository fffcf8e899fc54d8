// Package mochitest is what tests that run a bare mochi-mqtt broker (its
// listener a mochilisten.Listener, hooks of their own) share: starting one, letting everyone
// in, and closing it.
package mochitest

import (
	"fmt"
	"log/slog"
	"testing"

	"github.com/devicecompanion/companion/internal/mochilisten"
	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// AllowAll lets every client connect and publish or subscribe anything,
// like mochi's auth.AllowHook (whose package needs a module this one does
// not require).
type AllowAll struct{ mochi.HookBase }

func (AllowAll) ID() string { return "allow-all" }

func (AllowAll) Provides(b byte) bool {
	return b == mochi.OnConnectAuthenticate || b == mochi.OnACLCheck
}

func (AllowAll) OnConnectAuthenticate(*mochi.Client, packets.Packet) bool { return true }

func (AllowAll) OnACLCheck(*mochi.Client, string, bool) bool { return true }

// Serve starts a broker on a free port of 127.0.0.1 with hooks (AllowAll
// when there are none) and returns it and its tcp:// URL. Stop it with
// Close.
func Serve(hooks ...mochi.Hook) (*mochi.Server, string, error) {
	if len(hooks) == 0 {
		hooks = []mochi.Hook{new(AllowAll)}
	}
	srv := mochi.New(&mochi.Options{Logger: slog.New(slog.DiscardHandler)})
	for _, h := range hooks {
		if err := srv.AddHook(h, nil); err != nil {
			return nil, "", fmt.Errorf("mochitest: hook %s: %w", h.ID(), err)
		}
	}
	l := mochilisten.New(listenerID, "tcp", "127.0.0.1:0", slog.New(slog.DiscardHandler))
	l.Disconnect = func() {
		for _, cl := range srv.Clients.GetAll() {
			if cl.Net.Listener == listenerID && !cl.Closed() {
				_ = srv.DisconnectClient(cl, packets.ErrServerShuttingDown)
			}
		}
	}
	if err := srv.AddListener(l); err != nil {
		return nil, "", fmt.Errorf("mochitest: %w", err)
	}
	if err := srv.Serve(); err != nil {
		l.Abandon()
		return nil, "", fmt.Errorf("mochitest: %w", err)
	}
	return srv, "tcp://" + l.Address(), nil
}

// listenerID names the broker's one listener.
const listenerID = "t"

// Start is Serve for a test: it fails tb on an error and closes the
// broker (Close) when the test ends.
func Start(tb testing.TB, hooks ...mochi.Hook) (*mochi.Server, string) {
	tb.Helper()
	srv, url, err := Serve(hooks...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { Close(srv) })
	return srv, url
}

// Close stops srv and returns once its listener's goroutines have ended
// (mochilisten.Listener): the listener disconnects the clients, closes
// every connection, and waits for their goroutines before mochi's Close
// waits on its own WaitGroup. Mochi's TCP listener, used before, let a
// connection accepted as the broker closed (a client that retries its
// connect) call that WaitGroup's Add while Close waited on it, which the
// race detector reports, and its Close could deadlock
// (mochi-mqtt/server#488: Clients.GetByListener takes the clients' read
// lock twice).
func Close(srv *mochi.Server) error {
	err := srv.Close()
	if l, ok := srv.Listeners.Get(listenerID); ok {
		if ml, ok := l.(*mochilisten.Listener); ok {
			ml.Wait()
		}
	}
	return err
}
