package embedded

import (
	"sync"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// willHook keeps mochi from publishing the Will of a connection the
// server closes and holds the Will of itself (Server.holdWill): a bridge
// it disconnects, or one whose connection a login of its own takes over.
// Mochi reads and resets a connection's Will on that connection's
// goroutine, the Will of a clean disconnect with a plain write; clearing
// the Will's flag from another goroutine, as the server did, raced that
// write (docs/reliability.md, bug 462). The hook is told of each Will on
// the connection's goroutine instead, and answers mochi with none.
type willHook struct {
	mqtt.HookBase

	mu    sync.Mutex
	wills map[*mqtt.Client]bool // connected with a Will still to publish → held by the server
}

// ID names the hook in mochi's log.
func (h *willHook) ID() string { return "companion-will" }

// Provides lists the events the hook handles.
func (h *willHook) Provides(b byte) bool {
	switch b {
	case mqtt.OnSessionEstablish, mqtt.OnWill, mqtt.OnDisconnect:
		return true
	}
	return false
}

// OnSessionEstablish notes a client that connects with a Will. Mochi
// calls it before the client is among its clients, where the server
// finds those it closes.
func (h *willHook) OnSessionEstablish(cl *mqtt.Client, pk packets.Packet) {
	if !pk.Connect.WillFlag {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.wills[cl] = false
}

// hold keeps cl's Will from being published as its connection closes. It
// reports whether cl has a Will that was still to be published and is
// now the server's to hold: not when cl has none, its Will is out, or it
// is held already.
func (h *willHook) hold(cl *mqtt.Client) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	held, ok := h.wills[cl]
	if !ok || held {
		return false
	}
	h.wills[cl] = true
	return true
}

// OnWill is called as mochi publishes cl's Will. A held Will becomes one
// that reaches nobody: mochi publishes it all the same, and no
// subscription matches an empty topic, nor is it retained.
func (h *willHook) OnWill(cl *mqtt.Client, will mqtt.Will) (mqtt.Will, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	held := h.wills[cl]
	delete(h.wills, cl)
	if held {
		return mqtt.Will{}, nil
	}
	return will, nil
}

// OnDisconnect forgets cl: its connection ended.
func (h *willHook) OnDisconnect(cl *mqtt.Client, _ error, _ bool) {
	h.forget(cl)
}

// forget drops what the hook knows of cl.
func (h *willHook) forget(cl *mqtt.Client) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.wills, cl)
}
