package broker

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
)

// A bridge's `at` that is no RFC 3339 time (no time zone, as Python's
// datetime.isoformat writes a naive time; a number of seconds since 1970,
// as time.time() gives) made the whole message malformed: a final reply
// was dropped, so its command never ended, and a status was dropped, so
// the device never read online. The message is taken: a number is its
// seconds since 1970, anything else is taken as no `at` (as a message
// without one is) and logged, once a minute per device (bug 425).
func TestABridgesAtOutsideRFC3339(t *testing.T) {
	var logs testenv.Buffer
	e := newEnvTuned(t, true, nil, func(o *Options) {
		o.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	fb := connectBridge(t, e)
	ctx := context.Background()
	pub := func(topic, payload string) {
		t.Helper()
		require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, false, []byte(payload)), 5*time.Second))
	}

	// Seconds since 1970, with a fraction: the status's last_seen.
	at := time.Now().UTC().Truncate(time.Millisecond).Add(-time.Minute)
	status, _ := tree.Status("dev-1")
	pub(status, fmt.Sprintf(`{"online":true,"battery":87,"firmware_version":"1.0.0","apps":[],"bridge_id":"b1","at":%d.%03d,"seq":5}`,
		at.Unix(), at.Nanosecond()/1e6))
	testenv.Eventually(t, 10*time.Second, "dev-1's status at epoch seconds stored", func() bool {
		s, err := e.db.Status(ctx, "dev-1")
		return err == nil && s.Seq == 5
	})
	s, err := e.db.Status(ctx, "dev-1")
	require.NoError(t, err)
	assert.True(t, at.Equal(s.LastSeen), "last_seen %v; want %v", s.LastSeen, at)

	// No time zone: taken, without its at, and said.
	pub(status, `{"online":true,"battery":86,"firmware_version":"1.0.0","apps":[],"bridge_id":"b1","at":"2026-11-23T15:04:05.123456","seq":6}`)
	testenv.Eventually(t, 10*time.Second, "dev-1's status without a time zone stored", func() bool {
		s, err := e.db.Status(ctx, "dev-1")
		return err == nil && s.Seq == 6
	})
	s, err = e.db.Status(ctx, "dev-1")
	require.NoError(t, err)
	assert.True(t, s.LastSeen.IsZero(), "last_seen %v of a status whose at has no zone; want none", s.LastSeen)

	settings, _ := tree.Settings("dev-1")
	pub(settings, `{"reported":{"volume":20},"schema":{"volume":{"type":"int","min":0,"max":100,"default":50}},"at":"2026-11-23 15:04:05","seq":7}`)
	testenv.Eventually(t, 10*time.Second, "dev-1's settings without a time zone stored", func() bool {
		s, err := e.db.Settings(ctx, "dev-1")
		return err == nil && s.Seq == 7
	})

	c := submit(t, e, "dev-1", "hello", time.Hour)
	fb.next(t)
	replies, _ := tree.Replies("dev-1")
	pub(replies, fmt.Sprintf(`{"command_id":%q,"state":%q,"at":"2026-11-23T15:04:05"}`, c.ID, companion.StateSucceeded))
	testenv.Eventually(t, 10*time.Second, "the command whose final reply's at has no time zone succeeded", func() bool {
		return state(t, e, c.ID).State == companion.StateSucceeded
	})
	testenv.Eventually(t, 10*time.Second, "each unreadable at logged", func() bool {
		return strings.Count(logs.String(), `no RFC 3339 time`) >= 3
	})
	assert.Contains(t, logs.String(), `message=settings at="\"2026-11-23 15:04:05\""`, "the at as the bridge wrote it")
}
