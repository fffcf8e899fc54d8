package natsauth_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/nats-io/nkeys"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/broker/natsauth"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/natstest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

const wait = 15 * time.Second

// fakeStore is a hand-written natsauth.Store.
type fakeStore struct {
	mu      sync.Mutex
	bridges map[string]string // id → secret
	users   map[string]string // id → token
	owner   map[string]string // device → user
	serves  map[string]string // device → bridge
	fail    bool              // every read fails
	// read, when set, is called by ServedDevices and ListBindings with
	// the account asked about, once the store is read and before the
	// answer is returned.
	read func(account string)
}

func newFakeStore() *fakeStore {
	return &fakeStore{bridges: map[string]string{}, users: map[string]string{}, owner: map[string]string{}, serves: map[string]string{}}
}

func hash(s string) []byte {
	h := sha256.Sum256([]byte(s))
	return h[:]
}

var errDown = errors.New("store down")

func (f *fakeStore) Bridge(_ context.Context, id string) (companion.Bridge, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail {
		return companion.Bridge{}, errDown
	}
	s, ok := f.bridges[id]
	if !ok {
		return companion.Bridge{}, companion.ErrNotFound
	}
	return companion.Bridge{ID: id, SecretHash: hash(s)}, nil
}

func (f *fakeStore) User(_ context.Context, id string) (companion.User, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail {
		return companion.User{}, errDown
	}
	t, ok := f.users[id]
	if !ok {
		return companion.User{}, companion.ErrNotFound
	}
	return companion.User{ID: id, TokenHash: hash(t)}, nil
}

func (f *fakeStore) Binding(_ context.Context, dev string) (companion.Binding, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	u, ok := f.owner[dev]
	if !ok {
		return companion.Binding{}, companion.ErrNotFound
	}
	return companion.Binding{DeviceID: dev, UserID: u}, nil
}

func (f *fakeStore) BridgeServes(_ context.Context, bridge, dev string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.serves[dev] == bridge, nil
}

func (f *fakeStore) ServedDevices(_ context.Context, bridge string) ([]string, error) {
	f.mu.Lock()
	if f.fail {
		f.mu.Unlock()
		return nil, errDown
	}
	var out []string
	for d, b := range f.serves {
		if b == bridge {
			out = append(out, d)
		}
	}
	read := f.read
	f.mu.Unlock()
	sort.Strings(out)
	if read != nil {
		read(bridge)
	}
	return out, nil
}

func (f *fakeStore) ListBindings(_ context.Context, user, _ string, _ int) ([]companion.Binding, error) {
	f.mu.Lock()
	if f.fail {
		f.mu.Unlock()
		return nil, errDown
	}
	var out []companion.Binding
	for d, u := range f.owner {
		if u == user {
			out = append(out, companion.Binding{DeviceID: d, UserID: u})
		}
	}
	read := f.read
	f.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].DeviceID < out[j].DeviceID })
	if read != nil {
		read(user)
	}
	return out, nil
}

func (f *fakeStore) set(fn func(f *fakeStore)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

func TestSubjects(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []string
	}{
		{"companion/v1/devices/dev-1/status", []string{"companion.v1.devices.dev-1.status"}},
		{"companion/v1/devices/dev-1/#", []string{"companion.v1.devices.dev-1.>", "companion.v1.devices.dev-1"}},
		{"companion/v1/devices/+/replies", []string{"companion.v1.devices.*.replies"}},
		{"companion/v1/devices/d.1/commands/push.text", []string{"companion.v1.devices.d//1.commands.push//text"}},
		{"#", []string{">"}},
	} {
		got, err := natsauth.Subjects(c.in)
		if assert.NoError(t, err, c.in) {
			assert.Equal(t, c.want, got, "Subjects(%q)", c.in)
		}
	}
	for _, bad := range []string{"", "$MQTT/sub", "a//b", "a/#/b", "a/b+", "a b", "a/*", "a/>"} {
		_, err := natsauth.Subjects(bad)
		assert.Error(t, err, "Subjects(%q)", bad)
	}
}

// door is a natstest cluster in callout mode with a responder on it.
type door struct {
	cl   *natstest.Cluster
	st   *fakeStore
	r    *natsauth.Responder
	tree topics.Tree
	opts natsauth.Options // r's
}

// another starts a second responder on d's cluster and store, as another
// replica's, and returns it with read, which says whether it read the
// rights of an account (ServedDevices, ListBindings).
func (d *door) another(t *testing.T) (r *natsauth.Responder, read func(account string) bool) {
	t.Helper()
	st := &readsOf{fakeStore: d.st, accounts: map[string]bool{}}
	opts := d.opts
	opts.Store = st
	r, err := natsauth.New(opts)
	require.NoError(t, err)
	t.Cleanup(func() { r.Close() })
	return r, st.read
}

// readsOf is a responder's view of a fakeStore that notes whose rights it
// read.
type readsOf struct {
	*fakeStore
	mu       sync.Mutex
	accounts map[string]bool
}

func (s *readsOf) note(account string) {
	s.mu.Lock()
	s.accounts[account] = true
	s.mu.Unlock()
}

func (s *readsOf) read(account string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.accounts[account]
}

func (s *readsOf) ServedDevices(ctx context.Context, bridge string) ([]string, error) {
	s.note(bridge)
	return s.fakeStore.ServedDevices(ctx, bridge)
}

func (s *readsOf) ListBindings(ctx context.Context, user, after string, limit int) ([]companion.Binding, error) {
	s.note(user)
	return s.fakeStore.ListBindings(ctx, user, after, limit)
}

const serverUser, serverPass = "companion-server", "server-secret"

func startDoor(t *testing.T, edit func(*natsauth.Options)) *door {
	t.Helper()
	cl := natstest.StartCluster(t, natstest.Options{Callout: true})
	co := cl.Callout
	issuer, err := nkeys.FromSeed(co.IssuerSeed)
	require.NoError(t, err)
	d := &door{cl: cl, st: newFakeStore(), tree: topics.MustNew(topics.DefaultPrefix)}
	opts := natsauth.Options{
		URL:  co.URL,
		User: co.User, Password: co.Password,
		SystemUser: co.SystemUser, SystemPassword: co.SystemPassword,
		Issuer: issuer, Account: co.Account,
		Store:          d.st,
		ServerUsername: serverUser, ServerPassword: serverPass,
		Logger: testLogger(t),
	}
	if edit != nil {
		edit(&opts)
	}
	d.opts = opts
	d.r, err = natsauth.New(opts)
	require.NoError(t, err)
	t.Cleanup(func() { d.r.Close() })
	// Every node must know of the responder's subscription.
	for i := range cl.MQTTURLs {
		testenv.Eventually(t, 30*time.Second, fmt.Sprintf("the server logs in on nats-%d", i+1), func() bool {
			_, err := dialOnce(t, cl.MQTTURLs[i], "probe-login", serverUser, serverPass)
			return err == nil
		})
	}
	return d
}

func testLogger(t *testing.T) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// probe is a real paho client.
type probe struct{ *mqtttest.Probe }

func dialOnce(t *testing.T, url, id, user, pass string) (*probe, error) {
	t.Helper()
	p, err := mqtttest.DialProbe(t, url, id, user, pass)
	if err != nil {
		return nil, err
	}
	return &probe{p}, nil
}

func (d *door) dial(t *testing.T, node int, id, user, pass string) *probe {
	t.Helper()
	p, err := dialOnce(t, d.cl.MQTTURLs[node], id, user, pass)
	require.NoError(t, err, "%s logs in as %q on nats-%d", id, user, node+1)
	return p
}

func (p *probe) subscribe(t *testing.T, filter string) byte {
	t.Helper()
	tok := p.Subscribe(filter, 1, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(tok, wait))
	return tok.(*mqtt.SubscribeToken).Result()[filter]
}

func (p *probe) publish(t *testing.T, topic, payload string) {
	t.Helper()
	require.NoError(t, mqtt.WaitTokenTimeout(p.Publish(topic, 1, false, payload), wait))
}

// nextOn returns the next message on topic, skipping others; none of
// them may be a forged one.
func (p *probe) nextOn(t *testing.T, topic, why string) mqtt.Message {
	t.Helper()
	for {
		m := p.next(t, why)
		require.NotContains(t, string(m.Payload()), "forged", "%s: a refused publish went through on %s", why, m.Topic())
		if m.Topic() == topic {
			return m
		}
	}
}

// next returns the next message the probe receives.
func (p *probe) next(t *testing.T, why string) mqtt.Message {
	t.Helper()
	select {
	case m := <-p.Msgs:
		return m
	case <-time.After(wait):
		t.Fatalf("no message: %s", why)
		return nil
	}
}

func (p *probe) waitCut(t *testing.T, why string) {
	t.Helper()
	select {
	case <-p.Lost:
	case <-time.After(wait):
		t.Fatalf("the connection was not closed: %s", why)
	}
}

func must(t *testing.T) func(string, error) string {
	return func(s string, err error) string {
		t.Helper()
		require.NoError(t, err)
		return s
	}
}

// Every row of the door (CONTRACT §3, §9) against a real three-node
// cluster that asks the responder, with real paho clients on different
// nodes.
func TestDoor(t *testing.T) {
	d := startDoor(t, nil)
	d.st.set(func(f *fakeStore) {
		f.bridges["bridge-1"], f.bridges["bridge-2"] = "secret-1", "secret-2"
		f.users["alice"], f.users["bob"] = "token-a", "token-b"
		f.serves["dev-1"], f.serves["dev-2"], f.serves["dev-3"] = "bridge-1", "bridge-2", "bridge-1"
		f.owner["dev-1"], f.owner["dev-2"], f.owner["dev-3"] = "alice", "bob", "alice"
	})
	tree, m := d.tree, must(t)
	cmds := func(dev string) string { return m(tree.CommandsFilter(dev)) }
	text := func(dev string) string { return m(tree.Command(dev, topics.OpPushText)) }

	// The server, on nats-1, sees everything: the marker of what follows.
	srv := d.dial(t, 0, "companion-server", serverUser, serverPass)
	require.Equal(t, byte(1), srv.subscribe(t, tree.Prefix()+"/#"))
	marker := func(why string) {
		t.Helper()
		payload := "marker " + why
		srv.publish(t, m(tree.Status("dev-9")), payload)
		require.Equal(t, payload, string(srv.nextOn(t, m(tree.Status("dev-9")), why).Payload()))
	}

	t.Run("refused logins", func(t *testing.T) {
		for _, c := range []struct{ name, id, user, pass string }{
			{"anonymous", "anon", "", ""},
			{"user without a password", "nopass", "alice", ""},
			{"wrong token", "wrong-user", "alice", "token-b"},
			{"wrong bridge secret", "wrong-bridge", "bridge-1", "secret-2"},
			{"unknown name", "who", "mallory", "x"},
			{"wrong server password", "wrong-server", serverUser, "nope"},
			{"a user with the server's client id", "companion-server", "alice", "token-a"},
			{"a bridge with another bridge's client id", "companion-bridge-bridge-2", "bridge-1", "secret-1"},
			{"a bridge with a replica's client id", "companion-server-r2", "bridge-1", "secret-1"},
		} {
			_, err := dialOnce(t, d.cl.MQTTURLs[1], c.id, c.user, c.pass)
			assert.Error(t, err, c.name)
		}
		d.dial(t, 1, "companion-bridge-bridge-1", "bridge-1", "secret-1")
	})

	t.Run("a bridge", func(t *testing.T) {
		b := d.dial(t, 1, "probe-bridge-1", "bridge-1", "secret-1")
		assert.Equal(t, byte(1), b.subscribe(t, cmds("dev-1")))
		assert.Equal(t, byte(1), b.subscribe(t, text("dev-3")))
		assert.Equal(t, byte(0x80), b.subscribe(t, cmds("dev-2")), "another bridge's device")
		assert.Equal(t, byte(0x80), b.subscribe(t, tree.Prefix()+"/devices/+/commands/#"), "every device")
		assert.Equal(t, byte(0x80), b.subscribe(t, tree.AllReplies()))
		assert.Equal(t, byte(0x80), b.subscribe(t, tree.Prefix()+"/#"))
		srv.publish(t, text("dev-1"), "command")
		assert.Equal(t, text("dev-1"), b.next(t, "its device's command").Topic())

		b.publish(t, m(tree.Replies("dev-1")), "reply")
		assert.Equal(t, "reply", string(srv.nextOn(t, m(tree.Replies("dev-1")), "its reply").Payload()))
		b.publish(t, m(tree.BridgeState("bridge-1")), "online")
		assert.Equal(t, "online", string(srv.nextOn(t, m(tree.BridgeState("bridge-1")), "its state").Payload()))
		for _, topic := range []string{m(tree.Replies("dev-2")), m(tree.Status("dev-2")), m(tree.Settings("dev-2")),
			text("dev-1"), m(tree.BridgeState("bridge-2"))} {
			b.publish(t, topic, "forged") // acknowledged and dropped
		}
		marker("bridge-1's publishes for what is not its")
		assert.True(t, b.IsConnected(), "a refused publish costs the bridge its connection")
	})

	t.Run("a user", func(t *testing.T) {
		u := d.dial(t, 2, "alice-phone", "alice", "token-a")
		assert.Equal(t, byte(1), u.subscribe(t, m(tree.DeviceFilter("dev-1"))))
		assert.Equal(t, byte(1), u.subscribe(t, m(tree.Status("dev-3"))))
		assert.Equal(t, byte(0x80), u.subscribe(t, m(tree.DeviceFilter("dev-2"))), "bob's device")
		assert.Equal(t, byte(0x80), u.subscribe(t, tree.Prefix()+"/devices/+/status"))
		assert.Equal(t, byte(0x80), u.subscribe(t, tree.Prefix()+"/#"))
		srv.publish(t, m(tree.Status("dev-1")), "status")
		assert.Equal(t, m(tree.Status("dev-1")), u.next(t, "its device's status").Topic())
		u.publish(t, text("dev-1"), "forged")
		u.publish(t, m(tree.Status("dev-1")), "forged")
		marker("alice's publishes")
	})

	t.Run("moving a device moves the rights at once", func(t *testing.T) {
		b1 := d.dial(t, 0, "mover-1", "bridge-1", "secret-1")
		b2 := d.dial(t, 1, "mover-2", "bridge-2", "secret-2")
		require.Equal(t, byte(1), b1.subscribe(t, cmds("dev-1")))
		require.Equal(t, byte(0x80), b2.subscribe(t, cmds("dev-1")))
		d.st.set(func(f *fakeStore) { f.serves["dev-1"] = "bridge-2" })
		require.NoError(t, d.r.Assigned(context.Background(), "dev-1", "bridge-1", "bridge-2"))
		b1.waitCut(t, "bridge-1 lost dev-1")
		b2.waitCut(t, "bridge-2 got dev-1")
		b1 = d.dial(t, 0, "mover-1", "bridge-1", "secret-1")
		b2 = d.dial(t, 1, "mover-2", "bridge-2", "secret-2")
		assert.Equal(t, byte(0x80), b1.subscribe(t, cmds("dev-1")))
		assert.Equal(t, byte(1), b1.subscribe(t, cmds("dev-3")))
		assert.Equal(t, byte(1), b2.subscribe(t, cmds("dev-1")))
		srv.publish(t, text("dev-1"), "to bridge-2")
		assert.Equal(t, "to bridge-2", string(b2.next(t, "dev-1's command on bridge-2").Payload()))
		b1.publish(t, m(tree.Replies("dev-1")), "forged by bridge-1")
		marker("bridge-1's reply for the device it left")
		srv.publish(t, text("dev-3"), "to bridge-1")
		assert.Equal(t, "to bridge-1", string(b1.next(t, "bridge-1 got dev-1's command").Payload()))
	})

	t.Run("binding and unbinding", func(t *testing.T) {
		u := d.dial(t, 0, "alice-watch", "alice", "token-a")
		require.Equal(t, byte(1), u.subscribe(t, m(tree.DeviceFilter("dev-3"))))
		d.st.set(func(f *fakeStore) { delete(f.owner, "dev-3") })
		require.NoError(t, d.r.Unbound(context.Background(), "alice", "dev-3"))
		u.waitCut(t, "unbound")
		u = d.dial(t, 0, "alice-watch", "alice", "token-a")
		assert.Equal(t, byte(0x80), u.subscribe(t, m(tree.DeviceFilter("dev-3"))))
		d.st.set(func(f *fakeStore) { f.owner["dev-3"] = "alice" })
		require.NoError(t, d.r.Bound(context.Background(), "alice", "dev-3"))
		// Bound cuts nobody (bug 349): the device comes with the next login.
		assert.Equal(t, byte(0x80), u.subscribe(t, m(tree.DeviceFilter("dev-3"))), "on the login made before the bind")
		assert.True(t, u.IsConnected(), "alice's connection, cut by a bind")
		u = d.dial(t, 1, "alice-watch-2", "alice", "token-a")
		assert.Equal(t, byte(1), u.subscribe(t, m(tree.DeviceFilter("dev-3"))))
	})

	t.Run("a deleted bridge is cut off", func(t *testing.T) {
		b := d.dial(t, 2, "doomed", "bridge-2", "secret-2")
		d.st.set(func(f *fakeStore) { delete(f.bridges, "bridge-2") })
		require.NoError(t, d.r.BridgeDeleted(context.Background(), "bridge-2"))
		b.waitCut(t, "deleted")
		_, err := dialOnce(t, d.cl.MQTTURLs[2], "doomed", "bridge-2", "secret-2")
		assert.Error(t, err)
	})

	t.Run("a store that cannot be read lets nobody in", func(t *testing.T) {
		d.st.set(func(f *fakeStore) { f.fail = true })
		defer d.st.set(func(f *fakeStore) { f.fail = false })
		_, err := dialOnce(t, d.cl.MQTTURLs[0], "when-down", "bridge-1", "secret-1")
		assert.Error(t, err)
	})
}

// A change of rights closes the logins under way too: a login whose
// rights were read before the change and answered after it (the change
// finding no connection of the account to close yet) would keep rights
// the account no longer has until it logs in again.
func TestChangeDuringLogin(t *testing.T) {
	d := startDoor(t, nil)
	changeDuringLogin(t, d, func(string) *natsauth.Responder { return d.r })
}

// A login answered by one replica's responder while another replica
// changes its rights is closed too (bug 233): the replica that changes
// them does not know of the login, which no node lists yet; the one
// answering it is told (CONTRACT §11: the door's rules hold on the
// cluster, whichever replica serves the change).
func TestChangeDuringLoginAnsweredByAnotherReplica(t *testing.T) {
	d := startDoor(t, nil)
	r2, read := d.another(t)
	changeDuringLogin(t, d, func(account string) *natsauth.Responder {
		if read(account) {
			return d.r // r2 answers the login
		}
		return r2
	})
}

// changeDuringLogin changes the rights of a login held as its rights are
// read, through the responder changeOn names for the account, and checks
// that the login does not keep its old rights.
func changeDuringLogin(t *testing.T, d *door, changeOn func(account string) *natsauth.Responder) {
	d.st.set(func(f *fakeStore) {
		f.bridges["bridge-1"], f.bridges["bridge-2"], f.bridges["bridge-3"] = "secret-1", "secret-2", "secret-3"
		f.users["alice"] = "token-a"
		f.serves["dev-1"], f.serves["dev-3"] = "bridge-1", "bridge-3"
		f.owner["dev-2"] = "alice"
	})
	m, ctx := must(t), context.Background()
	for _, c := range []struct {
		name, user, pass, filter string
		change                   func(*natsauth.Responder) error
	}{
		{"a device moved away", "bridge-1", "secret-1", m(d.tree.CommandsFilter("dev-1")), func(r *natsauth.Responder) error {
			d.st.set(func(f *fakeStore) { f.serves["dev-1"] = "bridge-2" })
			return r.Assigned(ctx, "dev-1", "bridge-1", "bridge-2")
		}},
		{"a device unbound", "alice", "token-a", m(d.tree.DeviceFilter("dev-2")), func(r *natsauth.Responder) error {
			d.st.set(func(f *fakeStore) { delete(f.owner, "dev-2") })
			return r.Unbound(ctx, "alice", "dev-2")
		}},
		{"a bridge deleted", "bridge-3", "secret-3", m(d.tree.CommandsFilter("dev-3")), func(r *natsauth.Responder) error {
			d.st.set(func(f *fakeStore) { delete(f.bridges, "bridge-3"); delete(f.serves, "dev-3") })
			return r.BridgeDeleted(ctx, "bridge-3")
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			held, release := make(chan struct{}), make(chan struct{})
			var once sync.Once
			d.st.set(func(f *fakeStore) {
				f.read = func(account string) {
					if account == c.user {
						once.Do(func() { close(held); <-release })
					}
				}
			})
			defer d.st.set(func(f *fakeStore) { f.read = nil })
			type login struct {
				p   *probe
				err error
			}
			done := make(chan login, 1)
			go func() {
				p, err := dialOnce(t, d.cl.MQTTURLs[1], "racer-"+c.user, c.user, c.pass)
				done <- login{p, err}
			}()
			select {
			case <-held:
			case <-time.After(wait):
				t.Fatal("the login did not read the store")
			}
			require.NoError(t, c.change(changeOn(c.user)))
			close(release)
			l := <-done
			if l.err != nil {
				return // refused or closed: it logs in again with its rights of now
			}
			assert.NotEqual(t, byte(1), l.p.subscribe(t, c.filter), "%s: the login under way kept the rights", c.name)
			l.p.waitCut(t, "a login under way while its rights changed")
		})
	}
}

// NATS publishes a closed connection's Will with the rights the
// connection logged in with: a bridge closed because a device left it
// still puts its Will on that device's topics after the move, retained
// if it asked. The responder cannot refuse such a Will (NATS does not
// show Wills to the auth callout); docs/scale-out.md says so. This shows
// it on NATS 2.15.2.
func TestWillOfAClosedBridgeHasItsOldRights(t *testing.T) {
	d := startDoor(t, nil)
	d.st.set(func(f *fakeStore) {
		f.bridges["bridge-1"], f.bridges["bridge-2"] = "secret-1", "secret-2"
		f.serves["dev-1"] = "bridge-1"
	})
	status := must(t)(d.tree.Status("dev-1"))
	srv := d.dial(t, 0, "companion-server", serverUser, serverPass)
	require.Equal(t, byte(1), srv.subscribe(t, status))
	b := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(d.cl.MQTTURLs[1]).
		SetClientID("companion-bridge-bridge-1").SetUsername("bridge-1").SetPassword("secret-1").
		SetProtocolVersion(4).SetAutoReconnect(false).
		SetWill(status, "will", 1, true))
	require.NoError(t, mqtt.WaitTokenTimeout(b.Connect(), wait))
	t.Cleanup(func() { b.Disconnect(50) })

	d.st.set(func(f *fakeStore) { f.serves["dev-1"] = "bridge-2" })
	require.NoError(t, d.r.Assigned(context.Background(), "dev-1", "bridge-1", "bridge-2"))
	assert.Equal(t, "will", string(srv.next(t, "bridge-1's Will, after dev-1 left it").Payload()))
	later := d.dial(t, 2, "later", serverUser, serverPass)
	require.Equal(t, byte(1), later.subscribe(t, status))
	assert.Equal(t, "will", string(later.next(t, "the Will, retained").Payload()))
}

// A login with a client id that another account has a connection open
// with, on any node, is refused, and that connection stays up: NATS
// itself would close it (a takeover), as the embedded broker does not.
// The account that holds the client id may take it over.
func TestClientIDOfAnotherAccount(t *testing.T) {
	d := startDoor(t, nil)
	d.st.set(func(f *fakeStore) {
		f.bridges["bridge-1"] = "secret-1"
		f.users["alice"], f.users["bob"] = "token-a", "token-b"
		f.owner["dev-2"] = "bob"
	})
	status := must(t)(d.tree.Status("dev-2"))
	srv := d.dial(t, 0, "companion-server", serverUser, serverPass)
	bob := d.dial(t, 0, "bob-phone", "bob", "token-b")
	require.Equal(t, byte(1), bob.subscribe(t, status))

	for _, c := range []struct{ who, user, pass string }{
		{"another user", "alice", "token-a"},
		{"a bridge", "bridge-1", "secret-1"},
		{"the server", serverUser, serverPass},
	} {
		for node, url := range d.cl.MQTTURLs {
			_, err := dialOnce(t, url, "bob-phone", c.user, c.pass)
			assert.Error(t, err, "%s logs in with bob's client id on nats-%d", c.who, node+1)
		}
	}
	srv.publish(t, status, "after the refused logins")
	assert.Equal(t, "after the refused logins", string(bob.next(t, "bob's connection stays up").Payload()))
	select {
	case err := <-bob.Lost:
		t.Fatalf("bob's connection was closed: %v", err)
	default:
	}

	bob2 := d.dial(t, 2, "bob-phone", "bob", "token-b")
	bob.waitCut(t, "bob logged in again with his client id, on another node")
	assert.True(t, bob2.IsConnected())
}

// A refused login is forgotten before its answer goes: another account
// logs in with its client id at once. Before, the refused login was let go only after its answer,
// and a login a moment later with that client id, answered meanwhile, was
// refused as taken by the refused one (bug 247; TestClientIDOfAnotherAccount
// failed so once under load).
func TestARefusedLoginDoesNotHoldItsClientID(t *testing.T) {
	d := startDoor(t, nil)
	d.st.set(func(f *fakeStore) {
		f.users["alice"], f.users["bob"] = "token-a", "token-b"
	})
	// Each refusal's answering goroutine waits here, its answer sent,
	// until bob has logged in.
	release := make(chan struct{})
	natsauth.OnAnswered(d.r, func(refused bool) {
		if refused {
			select {
			case <-release:
			case <-time.After(30 * time.Second):
			}
		}
	})
	defer close(release)

	_, err := dialOnce(t, d.cl.MQTTURLs[0], "bob-phone", "alice", "wrong")
	require.Error(t, err, "a wrong password")
	bob := d.dial(t, 0, "bob-phone", "bob", "token-b")
	assert.True(t, bob.IsConnected())
}

// Two accounts logging in with one client id at the same moment: NATS
// lists a connection only once its node has the answer, so the later
// login found no holder in the cluster while the earlier was still being
// answered, was let in too, and took over (closed) the earlier one's
// connection. The login begun first wins; the later is refused.
func TestClientIDOfALoginUnderWay(t *testing.T) {
	d := startDoor(t, nil)
	d.st.set(func(f *fakeStore) { f.users["alice"], f.users["bob"] = "token-a", "token-b" })
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	d.st.set(func(f *fakeStore) {
		f.read = func(account string) {
			if account == "alice" {
				once.Do(func() { close(held); <-release })
			}
		}
	})
	defer d.st.set(func(f *fakeStore) { f.read = nil })
	type login struct {
		p   *probe
		err error
	}
	first := make(chan login, 1)
	go func() {
		p, err := dialOnce(t, d.cl.MQTTURLs[0], "shared-id", "alice", "token-a")
		first <- login{p, err}
	}()
	select {
	case <-held: // alice's login is past the client id check, reading her rights
	case <-time.After(wait):
		t.Fatal("alice's login did not read the store")
	}
	_, err := dialOnce(t, d.cl.MQTTURLs[0], "shared-id", "bob", "token-b")
	assert.Error(t, err, "bob logged in with the client id of alice's login under way")
	close(release)
	a := <-first
	require.NoError(t, a.err, "alice's login, begun first")
	select {
	case err := <-a.p.Lost:
		t.Fatalf("alice's connection was closed: %v", err)
	case <-time.After(500 * time.Millisecond):
	}
}

// Rights too large for one NATS message are refused, saying so; the
// documented size is let in: 1,000 devices of the longest ids, for a
// bridge and for a user, fit in NATS's default max_payload (1 MB).
func TestManyDevices(t *testing.T) {
	const documented = 1000
	d := startDoor(t, nil)
	devs := func(n int, tag string) []string {
		out := make([]string, n)
		for i := range out {
			id := fmt.Sprintf("%s-%05d-", tag, i)
			out[i] = id + strings.Repeat("x", topics.MaxDeviceIDLen-len(id))
		}
		return out
	}
	d.st.set(func(f *fakeStore) {
		f.bridges["big"], f.bridges["huge"] = "s", "s"
		f.users["many"] = "t"
		for _, dev := range devs(documented, "b") {
			f.serves[dev] = "big"
		}
		for _, dev := range devs(3*documented, "h") {
			f.serves[dev] = "huge"
		}
		for _, dev := range devs(documented, "u") {
			f.owner[dev] = "many"
		}
	})
	b := d.dial(t, 0, "big", "big", "s")
	last := devs(documented, "b")[documented-1]
	assert.Equal(t, byte(1), b.subscribe(t, must(t)(d.tree.CommandsFilter(last))))
	u := d.dial(t, 1, "many", "many", "t")
	last = devs(documented, "u")[documented-1]
	assert.Equal(t, byte(1), u.subscribe(t, must(t)(d.tree.DeviceFilter(last))))
	_, err := dialOnce(t, d.cl.MQTTURLs[2], "huge", "huge", "s")
	assert.Error(t, err, "a bridge of too many devices")
}

// Without a system user, rights change at the next login only, and
// Disconnect says so.
func TestNoSystemUser(t *testing.T) {
	d := startDoor(t, func(o *natsauth.Options) { o.SystemUser, o.SystemPassword = "", "" })
	err := d.r.Assigned(context.Background(), "dev-1", "bridge-1", "")
	assert.ErrorIs(t, err, natsauth.ErrNoSystemUser)
}

func TestNewChecksOptions(t *testing.T) {
	acc, err := nkeys.CreateAccount()
	require.NoError(t, err)
	user, err := nkeys.CreateUser()
	require.NoError(t, err)
	good := natsauth.Options{URL: "nats://127.0.0.1:1", User: "a", Password: "b", Issuer: acc, Store: newFakeStore(),
		ServerUsername: "s", ServerPassword: "p"}
	for name, edit := range map[string]func(*natsauth.Options){
		"no URL":            func(o *natsauth.Options) { o.URL = "" },
		"no auth user":      func(o *natsauth.Options) { o.User = "" },
		"no issuer":         func(o *natsauth.Options) { o.Issuer = nil },
		"a user key":        func(o *natsauth.Options) { o.Issuer = user },
		"no store":          func(o *natsauth.Options) { o.Store = nil },
		"no server account": func(o *natsauth.Options) { o.ServerPassword = "" },
		"half a system user": func(o *natsauth.Options) {
			o.SystemUser = "sys"
		},
	} {
		o := good
		edit(&o)
		_, err := natsauth.New(o)
		assert.Error(t, err, name)
	}
}

// NATS checks retained messages' publishers against its static users on
// a configuration reload: it deletes what the callout's clients retained
// (docs/scale-out.md says so; this shows it on NATS 2.15.2).
func TestReloadDropsRetainedMessagesOfCalloutClients(t *testing.T) {
	d := startDoor(t, nil)
	d.st.set(func(f *fakeStore) {
		f.bridges["bridge-1"] = "secret-1"
		f.users["alice"] = "token-a"
		f.serves["dev-1"] = "bridge-1"
		f.owner["dev-1"] = "alice"
	})
	status := must(t)(d.tree.Status("dev-1"))
	b := d.dial(t, 0, "companion-bridge-bridge-1", "bridge-1", "secret-1")
	require.NoError(t, mqtt.WaitTokenTimeout(b.Publish(status, 1, true, "retained"), wait))
	u := d.dial(t, 0, "alice-1", "alice", "token-a")
	require.Equal(t, byte(1), u.subscribe(t, status))
	assert.Equal(t, "retained", string(u.next(t, "the retained status").Payload()))

	d.cl.SetUsers(t, nil) // the same configuration, reloaded
	u2 := d.dial(t, 0, "alice-2", "alice", "token-a")
	require.Equal(t, byte(1), u2.subscribe(t, status))
	select {
	case m := <-u2.Msgs:
		t.Fatalf("the retained status outlived the reload: %s", m.Payload())
	case <-time.After(2 * time.Second):
	}
}
