package broker

import (
	"fmt"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
)

// A reply that names its command's id in upper case is that command's
// (bug 377): a UUID's hex digits are case-insensitive (RFC 9562 §4), and
// Swift's UUID.uuidString writes them in capitals, so a bridge on an
// iPhone that carried the id as a UUID answered in capitals, and the
// server, looking for the id as written, dropped every reply: no command
// of such a bridge ever ended. (Command ids in an HTTP path are
// case-insensitive since bug 55.)
func TestAReplyNamingItsCommandInCapitals(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	c := submit(t, e, "dev-1", "hello", time.Hour)
	fb.next(t)
	replies, _ := tree.Replies("dev-1")
	reply := func(state string) []byte {
		return []byte(fmt.Sprintf(`{"command_id":%q,"state":%q,"at":%q}`, strings.ToUpper(c.ID), state, time.Now().UTC().Format(time.RFC3339Nano)))
	}
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(replies, 1, false, reply(companion.StateDelivered)), 5*time.Second))
	testenv.Eventually(t, 10*time.Second, "delivered, as the reply in capitals said", func() bool {
		return state(t, e, c.ID).State == companion.StateDelivered
	})
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(replies, 1, false, reply(companion.StateSucceeded)), 5*time.Second))
	testenv.Eventually(t, 10*time.Second, "succeeded, as the reply in capitals said", func() bool {
		return state(t, e, c.ID).State == companion.StateSucceeded
	})
}
