package broker

import (
	"context"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// A bridge's state written with a line break after it ("offline\n", as
// `mosquitto_pub -l`, `echo` and many a config file write it), as a JSON
// string ("\"offline\"", from a bridge that encodes every payload as
// JSON) or in capitals is that state (bug 375): the server ignored it
// without a word, so the Will of such a bridge left its devices online
// for good.
func TestABridgeStateInAnotherSpelling(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	state, _ := tree.BridgeState("b1")
	for _, offline := range []string{"offline\n", "offline\r\n", `"offline"`, " Offline ", "OFFLINE"} {
		fb.online(t, e, "dev-1")
		require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(state, 1, true, []byte(offline)), 5*time.Second))
		testenv.Eventually(t, 10*time.Second, "dev-1 offline after the bridge's "+offline, func() bool {
			s, _ := e.db.Status(context.Background(), "dev-1")
			return !s.Online
		})
	}
}
