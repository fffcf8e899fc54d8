package embedded

import (
	"sync"
	"time"

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
	wills map[*mqtt.Client]*willState // connected with a Will still to publish
}

// willState is what the hook knows of a connection with a Will.
type willState struct {
	held        bool // by the server: mochi is to publish none
	established bool // mochi sent its CONNACK and reads it (OnSessionEstablished)
}

// deadAfter is how long after its connection closed a connection that
// never got to OnSessionEstablished is forgotten (sweepLocked). Mochi
// calls neither OnWill nor OnDisconnect for one whose CONNACK it could not
// send (closed, say by DisconnectBridge, as it was made): kept, each such
// connection stayed in the map for good (seen in make test, 2026-12-01).
// Between the CONNACK and OnSessionEstablished mochi only resends the
// session's inflight messages, well within a second.
const deadAfter = time.Second

// ID names the hook in mochi's log.
func (h *willHook) ID() string { return "companion-will" }

// Provides lists the events the hook handles.
func (h *willHook) Provides(b byte) bool {
	switch b {
	case mqtt.OnSessionEstablish, mqtt.OnSessionEstablished, mqtt.OnWill, mqtt.OnDisconnect:
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
	h.sweepLocked()
	h.wills[cl] = &willState{}
}

// OnSessionEstablished notes that mochi reads cl: its connection ends in
// OnWill or OnDisconnect.
func (h *willHook) OnSessionEstablished(cl *mqtt.Client, _ packets.Packet) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if w := h.wills[cl]; w != nil {
		w.established = true
	}
}

// sweepLocked forgets the connections closed deadAfter ago or more that
// mochi never read.
func (h *willHook) sweepLocked() {
	now := time.Now().Unix()
	for cl, w := range h.wills {
		if stopped := cl.StopTime(); !w.established && cl.Closed() && stopped > 0 && now-stopped >= int64(deadAfter/time.Second) {
			delete(h.wills, cl)
		}
	}
}

// hold keeps cl's Will from being published as its connection closes. It
// reports whether cl has a Will that was still to be published and is
// now the server's to hold: not when cl has none, its Will is out, or it
// is held already.
func (h *willHook) hold(cl *mqtt.Client) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	w, ok := h.wills[cl]
	if !ok || w.held {
		return false
	}
	w.held = true
	return true
}

// OnWill is called as mochi publishes cl's Will. A held Will becomes one
// that reaches nobody: mochi publishes it all the same, and no
// subscription matches an empty topic, nor is it retained.
func (h *willHook) OnWill(cl *mqtt.Client, will mqtt.Will) (mqtt.Will, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	w := h.wills[cl]
	delete(h.wills, cl)
	if w != nil && w.held {
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
