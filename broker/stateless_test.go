package broker

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
)

// A bridge whose block of Mosquitto's acl_file lacks its 'topic write
// …/bridges/ID/state' line runs every command and reports its devices,
// while Mosquitto drops its "online" and, once it is gone, its Will: its
// devices then read online for good. Nothing said so (docs/reliability.md,
// bug 496). The server must warn once, naming the bridge and the line, and
// count it, while the bridge beside it whose state comes is not named; the
// line granted and the bridge restarted, it is counted no more.
func TestABridgeWhoseStateNeverComesIsNamed(t *testing.T) {
	server := mqtttest.MosquittoAccount{Username: "companion-server", Password: "server-pw"}
	mute := mqtttest.MosquittoAccount{Username: "b1", Password: "b1-pw"}
	fine := mqtttest.MosquittoAccount{Username: "b2", Password: "b2-pw"}
	acl := `user companion-server
topic readwrite companion/v1/#

user b1
topic read companion/v1/devices/+/commands/#
topic write companion/v1/devices/+/replies
topic write companion/v1/devices/+/status
topic write companion/v1/devices/+/settings

user b2
topic read companion/v1/devices/+/commands/#
topic write companion/v1/devices/+/replies
topic write companion/v1/devices/+/status
topic write companion/v1/devices/+/settings
topic write companion/v1/bridges/b2/state
`
	mq := mqtttest.StartMosquittoStatic(t, []byte(acl), server, mute, fine)
	e := aclEnv(t, map[string]string{"b1": "dev-1", "b2": "dev-2"})
	logs, obs := startACLBroker(t, e, mq, server, func(b *Broker) { b.stateless.after = time.Second })
	// The bridges start after the server: what they report comes live.
	muteDir := t.TempDir()
	stopMute := runACLBridge(t, mq, mute, sim.New(sim.Options{ID: "dev-1", Logger: quiet()}), muteDir)
	runACLBridge(t, mq, fine, sim.New(sim.Options{ID: "dev-2", Logger: quiet()}), t.TempDir())
	waitOnline(t, e, "dev-1", "dev-2")
	// Its commands run: nothing but its state is amiss.
	c := submit(t, e, "dev-1", "hello", time.Hour)
	testenv.Eventually(t, 10*time.Second, "the mute bridge's command runs", func() bool {
		return state(t, e, c.ID).State == companion.StateSucceeded
	})

	const said = "has never said its state"
	testenv.Eventually(t, 20*time.Second, "the server names the bridge whose state never comes", func() bool {
		return strings.Contains(logs.String(), said)
	})
	time.Sleep(500 * time.Millisecond) // checks enough to repeat the warning, were it to
	out := logs.String()
	assert.Equal(t, 1, strings.Count(out, said), "%s", out)
	assert.Contains(t, out, "bridge_id=b1")
	assert.NotContains(t, out, "bridge_id=b2", "the bridge whose state came was named")
	assert.Contains(t, out, "'topic write companion/v1/bridges/b1/state'")
	assert.Contains(t, out, "'user b1'")
	assert.EqualValues(t, 1, obs.stateless.Load(), "bridges stateless")

	// Why it matters: the bridge gone, Mosquitto drops its offline and its
	// Will, and its device reads online still.
	stopMute()
	time.Sleep(time.Second)
	st, err := e.db.Status(context.Background(), "dev-1")
	require.NoError(t, err)
	assert.True(t, st.Online, "the device of a bridge whose state Mosquitto drops read offline once it was gone")

	// Granted the line and restarted, the bridge says online, and is
	// counted no more.
	mq.SetACL(t, []byte(strings.Replace(acl, "user b1\n", "user b1\ntopic write companion/v1/bridges/b1/state\n", 1)))
	runACLBridge(t, mq, mute, sim.New(sim.Options{ID: "dev-1", Logger: quiet()}), muteDir)
	testenv.Eventually(t, 10*time.Second, "no bridge stateless", func() bool { return obs.stateless.Load() == 0 })
}
