// Package mochitest is what tests that run a bare mochi-mqtt broker (a
// listeners.TCP, hooks of their own) share: starting one, letting everyone
// in, and closing it.
package mochitest

import (
	"fmt"
	"log/slog"
	"testing"

	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/listeners"
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
	l := listeners.NewTCP(listeners.Config{ID: "t", Address: "127.0.0.1:0"})
	if err := srv.AddListener(l); err != nil {
		return nil, "", fmt.Errorf("mochitest: %w", err)
	}
	if err := srv.Serve(); err != nil {
		return nil, "", fmt.Errorf("mochitest: %w", err)
	}
	return srv, "tcp://" + l.Address(), nil
}

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
