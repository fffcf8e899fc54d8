package broker

import (
	"context"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
)

// A reply's result is kept as the bridge wrote it, but its strings are
// made valid Unicode, as the error's message and every other string of
// the reply are (bug 370): bytes that are not UTF-8, and \u escapes of a
// lone surrogate, went into the command as sent, and GET …/commands/{id}
// answered a body that is not valid JSON text, which Swift's
// JSONDecoder, Kotlin's and many others refuse whole.
func TestAReplysResultIsValidUnicode(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	c := submit(t, e, "dev-1", "hello", time.Hour)
	fb.next(t)
	topic, _ := tree.Replies("dev-1")
	raw := "{\"command_id\":\"" + c.ID + "\",\"state\":\"succeeded\",\"at\":\"2026-12-01T00:00:00Z\"," +
		"\"result\":{\"name\":\"caf\xe9\",\"lone\":\"a\\ud800b\",\"low\":\"\\udc00\",\"pair\":\"\\ud83d\\ude00\",\"n\":12345678901234567890,\"s\":\"<&>\\u00e9\"}}"
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, false, []byte(raw)), 5*time.Second))
	testenv.Eventually(t, 10*time.Second, "succeeded", func() bool { return state(t, e, c.ID).State == companion.StateSucceeded })
	got, err := e.db.Command(context.Background(), c.ID)
	require.NoError(t, err)
	res := string(got.Result)
	assert.True(t, utf8.ValidString(res), "the result is not UTF-8: %q", res)
	assert.False(t, strings.Contains(strings.ToLower(res), `\ud800`) || strings.Contains(strings.ToLower(res), `\udc00`), "a lone surrogate kept: %q", res)
	assert.JSONEq(t, `{"name":"caf\ufffd","lone":"a\ufffdb","low":"\ufffd","pair":"\ud83d\ude00","n":12345678901234567890,"s":"<&>\u00e9"}`, res)
	assert.Contains(t, res, `12345678901234567890`, "the number as written")
}
