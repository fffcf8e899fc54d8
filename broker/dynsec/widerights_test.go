package dynsec_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/dynsec"
	"github.com/devicecompanion/companion/internal/mqtttest"
)

// lockedBuffer is a bytes.Buffer a logger and the test share.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A bridge's or a user's client that the server made, given by hand a
// role beside its own or put in a group, has that role's rights too: one
// granting the prefix lets a bridge read another customer's commands
// (CONTRACT §9). The server cannot know why the operator did it, so it
// takes nothing away, but names each such client, with what it holds
// and the commands that take it away, at every Reconcile (bug 497).
func TestAClientTheServerMadeWithRightsBesideItsOwnIsNamed(t *testing.T) {
	ctx := context.Background()
	mq := mqtttest.StartMosquitto(t, server)
	st := newBindings()
	logs := &lockedBuffer{}
	d, granted := newDriverWith(t, mq, server, dynsec.Options{Store: st,
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	require.True(t, granted)
	st.createBridge("b1", "secret-1")
	st.createBridge("b2", "secret-2")
	st.assign("dev-1", "b1")
	st.assign("dev-2", "b2")
	st.setUser("u1", "token-1")
	require.NoError(t, d.BridgeCreated(ctx, "b1", "secret-1"))
	require.NoError(t, d.BridgeCreated(ctx, "b2", "secret-2"))
	require.NoError(t, d.UserCreated(ctx, "u1", "token-1"))

	// The operator's doing: a role over the whole prefix, given to a
	// group that b1 joins, and to u1 directly.
	wide := []map[string]any{
		{"acltype": "subscribePattern", "topic": "companion/v1/#", "allow": true},
		{"acltype": "publishClientReceive", "topic": "companion/v1/#", "allow": true},
	}
	for _, r := range mq.Dynsec(t,
		map[string]any{"command": "createRole", "rolename": "fleet-read", "acls": wide},
		map[string]any{"command": "createGroup", "groupname": "fleet"},
		map[string]any{"command": "addGroupRole", "groupname": "fleet", "rolename": "fleet-read"},
		map[string]any{"command": "addGroupClient", "groupname": "fleet", "username": "b1"},
		map[string]any{"command": "addClientRole", "username": "u1", "rolename": "fleet-read"},
	) {
		require.Empty(t, r.Error, r.Command)
	}

	// What it costs: b1 reads b2's device's commands.
	b1, err := mqtttest.DialProbe(t, mq.URL, dynsec.BridgeClientID("b1"), "b1", "secret-1")
	require.NoError(t, err)
	tok := b1.Subscribe("companion/v1/devices/dev-2/commands/+", 1, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(tok, 5*time.Second))
	srv, err := mqtttest.DialProbe(t, mq.URL, "probe-server", server.Username, server.Password)
	require.NoError(t, err)
	require.NoError(t, mqtt.WaitTokenTimeout(srv.Publish("companion/v1/devices/dev-2/commands/push.text", 1, false, "b2's"), 5*time.Second))
	select {
	case m := <-b1.Msgs:
		require.Equal(t, "companion/v1/devices/dev-2/commands/push.text", m.Topic())
	case <-time.After(5 * time.Second):
		t.Fatal("the group's role did not let b1 read b2's device's commands: the test shows nothing")
	}

	require.NoError(t, d.Reconcile(ctx))
	var b1Line, u1Line string
	for _, l := range strings.Split(logs.String(), "\n") {
		if !strings.Contains(l, "rights beside those the server gives") {
			continue
		}
		switch {
		case strings.Contains(l, "username=b1"):
			b1Line = l
		case strings.Contains(l, "username=u1"):
			u1Line = l
		case strings.Contains(l, "username=b2"):
			t.Errorf("b2, with only its own role, named: %s", l)
		}
	}
	require.NotEmpty(t, b1Line, "the server never named b1, whose group reads every device's commands; log:\n%s", logs.String())
	require.NotEmpty(t, u1Line, "the server never named u1, who holds a role beside their own; log:\n%s", logs.String())
	assert.Contains(t, b1Line, "groups=[fleet]")
	assert.Contains(t, b1Line, "removeGroupClient fleet b1")
	assert.Contains(t, u1Line, "roles=[fleet-read]")
	assert.Contains(t, u1Line, "removeClientRole u1 fleet-read")

	// Taken away, nothing more is said.
	for _, r := range mq.Dynsec(t,
		map[string]any{"command": "removeGroupClient", "groupname": "fleet", "username": "b1"},
		map[string]any{"command": "removeClientRole", "username": "u1", "rolename": "fleet-read"},
	) {
		require.Empty(t, r.Error, r.Command)
	}
	before := strings.Count(logs.String(), "rights beside those the server gives")
	require.NoError(t, d.Reconcile(ctx))
	assert.Equal(t, before, strings.Count(logs.String(), "rights beside those the server gives"), "named again once taken away")
}
