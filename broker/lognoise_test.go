package broker

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

// A bridge (a user may run their own) that publishes malformed messages,
// or replies naming commands that do not exist, as fast as it can, made
// the server log a warning for each: an operator's log filled at the
// rate of one client's loop, burying everything else. Each such line is
// logged once a minute per device at most, saying how many like it were
// not (bug 379).
func TestABridgesBadMessagesAreLoggedOnceAMinute(t *testing.T) {
	var logs testenv.Buffer
	e := newEnvTuned(t, true, nil, func(o *Options) {
		o.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")

	const n = 100
	statusTopic, _ := tree.Status("dev-1")
	repliesTopic, _ := tree.Replies("dev-1")
	settingsTopic, _ := tree.Settings("dev-1")
	var toks []mqtt.Token
	for i := 0; i < n; i++ {
		toks = append(toks,
			fb.c.Publish(statusTopic, 1, false, []byte(`{"online": tru`)),
			fb.c.Publish(settingsTopic, 1, false, []byte(`[]`)),
			fb.c.Publish(repliesTopic, 1, false, []byte(`{"command_id": 7}`)))
		fb.reply(t, "dev-1", topics.Reply{CommandID: uuid.Must(uuid.NewV7()).String(), State: "succeeded", At: time.Now()})
	}
	for _, tok := range toks {
		require.NoError(t, mqtt.WaitTokenTimeout(tok, 5*time.Second))
	}
	// The server has taken them all in once a real command's reply,
	// sent after them, is stored.
	cmd := submit(t, e, "dev-1", "hello", time.Hour)
	require.Equal(t, cmd.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: cmd.ID, State: "succeeded", At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the command succeeded", func() bool {
		c, err := e.db.Command(context.Background(), cmd.ID)
		return err == nil && c.State == "succeeded"
	})

	for _, msg := range []string{`msg="bad status"`, `msg="bad settings"`, `msg="bad reply"`, `msg="reply for an unknown command ignored"`} {
		assert.Equal(t, 1, strings.Count(logs.String(), msg), "lines of %s for %d such messages; log:\n%s", msg, n, logs.String())
	}
}

// Bug 379 left out the lines a reply logs before its command is looked
// up: a reply carrying a status of another bridge, or settings that
// cannot be stored, was a warning each however often it came, and its
// command need not exist (bug 386).
func TestABridgesRepliesWithForeignReportsAreLoggedOnceAMinute(t *testing.T) {
	var logs testenv.Buffer
	e := newEnvTuned(t, true, nil, func(o *Options) {
		o.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")

	const n = 100
	for i := 0; i < n; i++ {
		fb.reply(t, "dev-1", topics.Reply{CommandID: uuid.Must(uuid.NewV7()).String(), State: "succeeded", At: time.Now(),
			Status: &topics.Status{Online: true, BridgeID: "b2", Seq: uint64(i + 1), At: time.Now()}})
		fb.reply(t, "dev-1", topics.Reply{CommandID: uuid.Must(uuid.NewV7()).String(), State: "succeeded", At: time.Now(),
			Status: &topics.Status{Online: true, BridgeID: "b1", Seq: uint64(1000 + i), At: time.Now(),
				Apps: []companion.App{{AppID: "weather", Version: "1.0.0"}, {AppID: "weather", Version: "1.0.1"}}}})
	}
	cmd := submit(t, e, "dev-1", "hello", time.Hour)
	require.Equal(t, cmd.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: cmd.ID, State: "succeeded", At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the command succeeded", func() bool {
		c, err := e.db.Command(context.Background(), cmd.ID)
		return err == nil && c.State == "succeeded"
	})
	for _, msg := range []string{
		`msg="reply with a status from a bridge that does not serve the device; storing the reply without it"`,
		`msg="the device lists an app more than once; keeping the first"`,
	} {
		assert.Equal(t, 1, strings.Count(logs.String(), msg), "lines of %s for %d such replies; log:\n%s", msg, n, logs.String())
	}
}
