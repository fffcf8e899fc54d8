package broker

import (
	"context"
	"fmt"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
)

// An integer of a bridge's message written with a fraction of zero (87.0,
// as Gson and kotlinx.serialization write a Kotlin Double, Python a float)
// is that integer, as JSON Schema's "integer" of docs/asyncapi.yaml reads
// it (bug 373): encoding/json refused it into an int, and the whole
// status, reply or settings message was dropped as malformed, so a phone
// bridge's devices never read their battery, and a final reply with
// "progress": 100.0 never ended its command. A fraction that is not zero
// is still refused.
func TestWholeNumbersOfABridgeAreIntegers(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	ctx := context.Background()
	pub := func(topic, payload string) {
		t.Helper()
		require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, false, []byte(payload)), 5*time.Second))
	}

	status, _ := tree.Status("dev-1")
	pub(status, `{"online":true,"battery":87.0,"firmware_version":"1.0.0","apps":[],"bridge_id":"b1","at":"`+time.Now().UTC().Format(time.RFC3339Nano)+`","seq":5.0}`)
	testenv.Eventually(t, 10*time.Second, "dev-1's status of battery 87.0 stored", func() bool {
		s, err := e.db.Status(ctx, "dev-1")
		return err == nil && s.Battery != nil && *s.Battery == 87 && s.Seq == 5
	})

	settings, _ := tree.Settings("dev-1")
	pub(settings, `{"reported":{"volume":20},"schema":{"volume":{"type":"int","min":0.0,"max":1e2,"default":50}},"at":"`+
		time.Now().UTC().Format(time.RFC3339Nano)+`","seq":6.0}`)
	testenv.Eventually(t, 10*time.Second, "dev-1's settings of seq 6.0 stored", func() bool {
		s, err := e.db.Settings(ctx, "dev-1")
		return err == nil && s.Seq == 6
	})

	c := submit(t, e, "dev-1", "hello", time.Hour)
	fb.next(t)
	replies, _ := tree.Replies("dev-1")
	reply := func(state, progress string) string {
		return fmt.Sprintf(`{"command_id":%q,"state":%q,"progress":%s,"at":%q}`, c.ID, state, progress, time.Now().UTC().Format(time.RFC3339Nano))
	}
	pub(replies, reply(companion.StateInProgress, "50.0"))
	testenv.Eventually(t, 10*time.Second, "in progress at 50.0", func() bool {
		got := state(t, e, c.ID)
		return got.State == companion.StateInProgress && got.Progress != nil && *got.Progress == 50
	})
	pub(replies, reply(companion.StateInProgress, "60.5")) // refused: no whole number
	pub(replies, reply(companion.StateSucceeded, "100.0"))
	testenv.Eventually(t, 10*time.Second, "succeeded with progress 100.0", func() bool {
		return state(t, e, c.ID).State == companion.StateSucceeded
	})
	assert.Equal(t, 100, *state(t, e, c.ID).Progress)
}
