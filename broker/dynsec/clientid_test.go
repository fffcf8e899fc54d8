package dynsec_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/dynsec"
	"github.com/devicecompanion/companion/internal/mqtttest"
)

// session is a client with a persistent session, as the server and the
// bridges connect.
type session struct {
	mqtt.Client
	lost chan error
}

func dialSession(t *testing.T, mq *mqtttest.Mosquitto, clientID, user, pass string) (*session, error) {
	t.Helper()
	s := &session{lost: make(chan error, 1)}
	s.Client = mqtt.NewClient(mqtt.NewClientOptions().AddBroker(mq.URL).SetClientID(clientID).
		SetUsername(user).SetPassword(pass).SetCleanSession(false).SetProtocolVersion(4).
		SetAutoReconnect(false).
		SetConnectionLostHandler(func(_ mqtt.Client, err error) { s.lost <- err }))
	if err := mqtt.WaitTokenTimeout(s.Connect(), 10*time.Second); err != nil {
		return nil, err
	}
	t.Cleanup(func() {
		if s.IsConnected() {
			s.Disconnect(50)
		}
	})
	return s, nil
}

// On Mosquitto a login with a client id that is connected closes that
// connection and takes its persistent session. With PinClientIDs no account
// the server makes may take the server's client id, a bridge's or another
// user's: the login is refused and the owner stays connected. Accounts
// made before client ids were tied get theirs on the next Reconcile.
func TestClientIDsBelongToTheirAccounts(t *testing.T) {
	ctx := context.Background()
	mq := mqtttest.StartMosquitto(t, server)
	st := newBindings()
	st.createBridge("b1", "secret-1")
	st.createBridge("b2", "secret-2")
	d, granted := newDriverWith(t, mq, server, dynsec.Options{Store: st, PinClientIDs: true})
	require.True(t, granted)
	require.NoError(t, d.UserCreated(ctx, "user-a", "token-a"))
	require.NoError(t, d.UserCreated(ctx, "user-b", "token-b"))
	require.NoError(t, d.BridgeCreated(ctx, "b1", "secret-1"))
	require.NoError(t, d.BridgeCreated(ctx, "b2", "secret-2"))

	type login struct{ user, pass string }
	userA, bridge2 := login{"user-a", "token-a"}, login{"b2", "secret-2"}

	// Each owner logs in with its own client id, as the server and the
	// bridges do.
	owners := map[string]*session{}
	for cid, who := range map[string]login{
		"companion-server":            {server.Username, server.Password},
		"companion-server-r2":         {server.Username, server.Password},
		dynsec.BridgeClientID("b1"):   {"b1", "secret-1"},
		dynsec.UserClientID("user-b"): {"user-b", "token-b"},
	} {
		s, err := dialSession(t, mq, cid, who.user, who.pass)
		require.NoError(t, err, "%s as %s", cid, who.user)
		owners[cid] = s
	}

	for _, tc := range []struct {
		who login
		cid string
	}{
		{userA, "companion-server"},
		{userA, "companion-server-r2"},
		{userA, dynsec.BridgeClientID("b1")},
		{userA, dynsec.UserClientID("user-b")},
		{userA, "anything-else"},
		{bridge2, "companion-server"},
		{bridge2, dynsec.BridgeClientID("b1")},
		{bridge2, dynsec.UserClientID("user-b")},
	} {
		_, err := dialSession(t, mq, tc.cid, tc.who.user, tc.who.pass)
		assert.Error(t, err, "%s logged in as %q", tc.who.user, tc.cid)
	}
	for cid, s := range owners {
		// A round trip on the owner's connection: it fails if the broker
		// closed the connection (a SUBACK, granted or refused, is enough).
		err := mqtt.WaitTokenTimeout(s.Subscribe("companion/v1/round-trip", 1, nil), 10*time.Second)
		assert.NoError(t, err, "%s lost its connection to another account's login", cid)
	}
	// Their own client ids they may use.
	for who, cid := range map[login]string{userA: dynsec.UserClientID("user-a"), bridge2: dynsec.BridgeClientID("b2")} {
		_, err := dialSession(t, mq, cid, who.user, who.pass)
		assert.NoError(t, err, "%s as its own %q", who.user, cid)
	}

	t.Run("accounts made before client ids were tied get theirs", func(t *testing.T) {
		// As an earlier server made them: no client id.
		for _, a := range []struct{ kind, name, role string }{
			{"user", "user-old", dynsec.UserRole("user-old")},
			{"bridge", "b-old", dynsec.BridgeRole("b-old")},
		} {
			for _, r := range mq.Dynsec(t,
				map[string]any{"command": "createRole", "rolename": a.role},
				map[string]any{"command": "createClient", "username": a.name, "password": "old-secret", "textname": "companion " + a.kind},
				map[string]any{"command": "addClientRole", "username": a.name, "rolename": a.role},
			) {
				require.Empty(t, r.Error, "%s", r.Command)
			}
		}
		st.createBridge("b-old", "old-secret")
		// An account the operator made stays as it is.
		for _, r := range mq.Dynsec(t, map[string]any{"command": "createClient", "username": "operator", "password": "op-secret", "textname": "by hand"}) {
			require.Empty(t, r.Error, "%s", r.Command)
		}

		old, err := dialSession(t, mq, "user-old-app", "user-old", "old-secret")
		require.NoError(t, err, "an untied account logs in with any client id")
		require.NoError(t, d.Reconcile(ctx))
		select {
		case <-old.lost: // the plugin disconnects a client whose id it ties
		case <-time.After(10 * time.Second):
			t.Fatal("the untied client stayed connected")
		}
		for name, want := range map[string]string{
			"user-old": dynsec.UserClientID("user-old"),
			"b-old":    dynsec.BridgeClientID("b-old"),
			"operator": "",
		} {
			r := mq.Dynsec(t, map[string]any{"command": "getClient", "username": name})
			require.Empty(t, r[0].Error)
			var got struct {
				Client struct {
					ClientID string `json:"clientid"`
				} `json:"client"`
			}
			require.NoError(t, json.Unmarshal(r[0].Data, &got))
			assert.Equal(t, want, got.Client.ClientID, "the client id of %s", name)
		}
		_, err = dialSession(t, mq, "companion-server", "user-old", "old-secret")
		assert.Error(t, err, "an account made before took the server's client id after Reconcile")
		_, err = dialSession(t, mq, dynsec.UserClientID("user-old"), "user-old", "old-secret")
		assert.NoError(t, err)
		assert.True(t, owners["companion-server"].IsConnected())

		// Made again over an untied client (a creation retried, or a
		// bridge created anew): the client id is tied too.
		require.Empty(t, mq.Dynsec(t, map[string]any{"command": "setClientId", "username": "b-old"})[0].Error)
		st.createBridge("b-old", "new-secret")
		require.NoError(t, d.BridgeCreated(ctx, "b-old", "new-secret"))
		_, err = dialSession(t, mq, "companion-server", "b-old", "new-secret")
		assert.Error(t, err, "a bridge made again over an untied client took the server's client id")
		_, err = dialSession(t, mq, dynsec.BridgeClientID("b-old"), "b-old", "new-secret")
		assert.NoError(t, err)
	})
}

// Without PinClientIDs a user and a bridge log in with any client id
// (CONTRACT §3's watcher, a probe beside a running bridge); an account tied
// by a server that pinned client ids is untied again by Reconcile.
func TestAnyClientIDUnlessPinned(t *testing.T) {
	ctx := context.Background()
	mq := mqtttest.StartMosquitto(t, server)
	st := newBindings()
	st.createBridge("b1", "secret-1")
	d, granted := newDriver(t, mq, server, st)
	require.True(t, granted)
	require.NoError(t, d.UserCreated(ctx, "user-a", "token-a"))
	require.NoError(t, d.BridgeCreated(ctx, "b1", "secret-1"))

	type login struct{ user, pass, own string }
	for _, who := range []login{
		{"user-a", "token-a", dynsec.UserClientID("user-a")},
		{"b1", "secret-1", dynsec.BridgeClientID("b1")},
	} {
		for _, cid := range []string{"mosq-watcher-" + who.user, who.own} {
			_, err := dialSession(t, mq, cid, who.user, who.pass)
			assert.NoError(t, err, "%s as %q", who.user, cid)
		}

		// As a server with PinClientIDs left it.
		require.Empty(t, mq.Dynsec(t, map[string]any{"command": "setClientId", "username": who.user, "clientid": who.own})[0].Error)
		_, err := dialSession(t, mq, "probe-"+who.user, who.user, who.pass)
		require.Error(t, err, "%s, pinned, logged in with another client id", who.user)
		require.NoError(t, d.Reconcile(ctx))
		_, err = dialSession(t, mq, "probe-"+who.user, who.user, who.pass)
		assert.NoError(t, err, "%s is still pinned after Reconcile", who.user)
	}
}
