package dynsec_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/dynsec"
	"github.com/devicecompanion/companion/internal/mqtttest"
)

// logs is a slog destination a test reads while the driver writes it.
type logs struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logs) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A server left with --mqtt-dynsec on against a Mosquitto run with the
// static password and ACL files (docs/mosquitto.md, section 3) has no
// plugin to answer it, and Mosquitto grants its subscription to the
// response topic all the same (an acl_file refuses no SUBSCRIBE), so the
// driver cannot learn it from the SUBACK. Every change then waited the
// whole timeout (10 s) for an answer, one after another, each admin request
// with it (docs/reliability.md, bug 268). After one request goes
// unanswered, changes fail at once until the plugin answers again, and the
// log says why.
func TestAMosquittoWithoutThePluginIsAskedOnce(t *testing.T) {
	ctx := context.Background()
	mq := mqtttest.StartMosquittoStatic(t, []byte("user companion-server\ntopic readwrite companion/v1/#\n"), server)
	st := newBindings()
	var out logs
	cn := dialConn(t, mq.URL, server.Username, server.Password)
	t.Cleanup(func() { cn.c.Disconnect(50) })
	d, err := dynsec.New(dynsec.Options{Conn: cn, Store: st, ServerUsername: server.Username,
		Timeout: 500 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&out, nil))})
	require.NoError(t, err)
	require.True(t, <-cn.granted, "Mosquitto with an ACL file refused the response topic: nothing to test")

	st.createBridge("bridge-1", "secret-1")
	err = d.BridgeCreated(ctx, "bridge-1", "secret-1")
	require.ErrorContains(t, err, "no answer from the plugin")

	st.assign("dev-1", "bridge-1")
	err = d.Assigned(ctx, "dev-1", "", "bridge-1")
	require.ErrorIs(t, err, dynsec.ErrUnavailable, "a change after an unanswered one waited for the plugin again")
	require.Contains(t, out.String(), "--mqtt-dynsec=false", "the log does not say what to do")
}

// A request left unanswered once (lost on its way) holds the changes back
// only until Reconcile has an answer: then the creation is made again and
// changes go through.
func TestChangesGoThroughOnceThePluginAnswersAgain(t *testing.T) {
	ctx := context.Background()
	mq := mqtttest.StartMosquitto(t, server)
	st := newBindings()
	cn := dialConn(t, mq.URL, server.Username, server.Password)
	t.Cleanup(func() { cn.c.Disconnect(50) })
	d, err := dynsec.New(dynsec.Options{Conn: cn, Store: st, ServerUsername: server.Username, Timeout: 500 * time.Millisecond})
	require.NoError(t, err)
	require.True(t, <-cn.granted)

	st.createBridge("bridge-1", "secret-1")
	cn.drop.Store(1)
	require.ErrorContains(t, d.BridgeCreated(ctx, "bridge-1", "secret-1"), "no answer from the plugin")
	st.assign("dev-1", "bridge-1")
	require.ErrorIs(t, d.Assigned(ctx, "dev-1", "", "bridge-1"), dynsec.ErrUnavailable)

	require.NoError(t, d.Reconcile(ctx))
	require.NoError(t, canConnect(mq, dynsec.BridgeClientID("bridge-1"), "bridge-1", "secret-1"), "the creation was not made again")
	require.Contains(t, roleACLs(t, mq, dynsec.BridgeRole("bridge-1")),
		dynsec.ACL{Type: dynsec.SubscribePattern, Topic: "companion/v1/devices/dev-1/commands/#", Allow: true})
	st.assign("dev-2", "bridge-1")
	require.NoError(t, d.Assigned(ctx, "dev-2", "", "bridge-1"))
}

// While the plugin's answer is awaited (a request went unanswered, bug
// 268), every change fails at once and asks for a retry. Changes coming
// more often than RetryInterval put the retry off each time, so the
// plugin was never asked again and every change failed for as long as
// they came (docs/reliability.md, bug 270). The retry comes RetryInterval
// after the first failure, whatever follows.
func TestFailingChangesDoNotPutTheRetryOff(t *testing.T) {
	ctx := context.Background()
	mq := mqtttest.StartMosquitto(t, server)
	st := newBindings()
	cn := dialConn(t, mq.URL, server.Username, server.Password)
	t.Cleanup(func() { cn.c.Disconnect(50) })
	d, err := dynsec.New(dynsec.Options{Conn: cn, Store: st, ServerUsername: server.Username,
		Timeout: 500 * time.Millisecond, RetryInterval: 400 * time.Millisecond})
	require.NoError(t, err)
	require.True(t, <-cn.granted)
	// The reconciling of the first connection comes before the test's
	// changes: a change waits for it to end (d.change).
	reconciling := make(chan struct{})
	var once sync.Once
	cn.hold = func(payload []byte) {
		if bytes.Contains(payload, []byte("listClients")) {
			once.Do(func() { close(reconciling) })
		}
	}
	d.Start()
	t.Cleanup(func() { _ = d.Close() })
	select {
	case <-reconciling:
	case <-time.After(10 * time.Second):
		t.Fatal("no reconciling at the start")
	}
	require.NoError(t, d.Assigned(ctx, "dev-none", "", ""), "a change that asks nothing of the plugin")

	st.createBridge("bridge-1", "secret-1")
	cn.drop.Store(1)
	require.ErrorContains(t, d.BridgeCreated(ctx, "bridge-1", "secret-1"), "no answer from the plugin")
	// A change every 100 ms, each failing until the retry has asked the
	// plugin again.
	deadline := time.Now().Add(10 * time.Second)
	for i := 0; ; i++ {
		dev := fmt.Sprintf("dev-%d", i)
		st.assign(dev, "bridge-1")
		err := d.Assigned(ctx, dev, "", "bridge-1")
		if err == nil {
			break
		}
		require.ErrorIs(t, err, dynsec.ErrUnavailable)
		require.True(t, time.Now().Before(deadline), "every change failed for 10 s: the retry never came")
		time.Sleep(100 * time.Millisecond)
	}
	require.NoError(t, canConnect(mq, dynsec.BridgeClientID("bridge-1"), "bridge-1", "secret-1"), "the creation was not made again")
}
