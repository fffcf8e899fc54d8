package main

import (
	"bytes"
	"context"
	"log/slog"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An operator whose admin command failed with "500 internal: internal
// error" had nothing to find its cause by in the server's log: the CLI
// left out the answer's X-Request-Id, the id the server's line of the
// failure says (bug 378). It names it for a 5xx now (bug 384).
func TestCLIServerErrorNamesTheRequestID(t *testing.T) {
	logs := &logCapture{}
	m := startServerWithLog(t, Config{}, logs)
	require.NotNil(t, m.bolt, "the test closes the bbolt store under the server")
	require.NoError(t, m.bolt.Close()) // every write now fails: a 5xx

	var out, errOut bytes.Buffer
	err := run(context.Background(), []string{"user", "create", "bob", "--api-url", m.APIURL(), "--admin-token", m.AdminToken()}, &out, &errOut)
	require.Error(t, err)
	t.Logf("the CLI said: %v", err)
	id := regexp.MustCompile(`request id ([A-Za-z0-9._:-]+)`).FindStringSubmatch(err.Error())
	require.NotNil(t, id, "the CLI's error names no request id: %v", err)
	assert.True(t, logs.has(slog.LevelDebug, "request failed", "request_id", id[1]),
		"no line of the server's says request_id=%s", id[1])
}
