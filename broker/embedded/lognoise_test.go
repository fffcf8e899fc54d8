package embedded_test

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/embedded"
	"github.com/devicecompanion/companion/internal/testenv"
)

// A bridge (a user may run their own) that publishes in a loop on the
// topics of a device it does not serve had the broker log a warning for
// each publish dropped: one client's loop filled the operator's log. The
// line is logged once a minute per bridge, saying how many it left out
// (bug 379).
func TestABridgesDroppedPublishesAreLoggedOnceAMinute(t *testing.T) {
	var logs testenv.Buffer
	s := startBrokerWith(t, embedded.Options{
		Accounts: newFakeAccounts(),
		Logger:   slog.New(slog.NewTextHandler(&logs, nil)),
	})

	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	require.Equal(t, byte(1), srv.subscribe(t, tp(tree.Status("dev-1"))))
	br := mustDial(t, s.Addr(), "bridge-1", "b1-secret", nil)
	const n = 100
	var toks []mqtt.Token
	for i := 0; i < n; i++ {
		toks = append(toks, br.Publish(tp(tree.Status("dev-2")), 1, false, `{}`)) // bridge-2's device
	}
	for _, tok := range toks {
		require.NoError(t, mqtt.WaitTokenTimeout(tok, wait))
	}
	br.publish(t, tp(tree.Status("dev-1")), false, `{}`)
	require.Equal(t, tp(tree.Status("dev-1")), srv.next(t).Topic())

	got := strings.Count(logs.String(), "mqtt publish for a device the bridge does not serve dropped")
	assert.Equal(t, 1, got, "lines for %d publishes dropped; log:\n%s", n, logs.String())
}

// Anyone who reaches the MQTT listener could have the broker log a line
// for every CONNECT it refused: a client retrying a wrong password in a
// loop, or a scanner, wrote as fast as it connected. The first refusal of
// a source address and reason is logged, the next ones once a minute with
// their count (bug 380).
func TestRefusedLoginsAreLoggedOnceAMinutePerSource(t *testing.T) {
	var logs testenv.Buffer
	s := startBrokerWith(t, embedded.Options{
		Accounts: newFakeAccounts(),
		Logger:   slog.New(slog.NewTextHandler(&logs, nil)),
	})

	const n = 50
	for i := 0; i < n; i++ {
		_, err := dial(t, s.Addr(), "bridge-1", "wrong", nil)
		require.Error(t, err)
	}
	got := 0
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, `msg="mqtt connect refused"`) && strings.Contains(l, `reason="bad credentials"`) {
			got++
		}
	}
	assert.Equal(t, 1, got, "lines for %d refused logins; log:\n%s", n, logs.String())
	// A refusal of another reason is its own line.
	_, err := dial(t, s.Addr(), "", "", nil)
	require.Error(t, err)
	assert.Contains(t, logs.String(), `reason=anonymous`)
}

// A client that sent a second CONNECT on its connection (a protocol
// violation mochi refuses) had mochi log the whole packet, its password
// with it, at warning level: a bridge's secret or a user's API token in
// the server's log (bug 381).
func TestASecondConnectLogsNoPassword(t *testing.T) {
	var logs testenv.Buffer
	s := startBrokerWith(t, embedded.Options{
		Accounts: newFakeAccounts(),
		Logger:   slog.New(slog.NewTextHandler(&logs, nil)),
	})

	conn, err := net.Dial("tcp", s.Addr())
	require.NoError(t, err)
	defer conn.Close()
	connect := func() []byte {
		pk := packets.Packet{
			FixedHeader:     packets.FixedHeader{Type: packets.Connect},
			ProtocolVersion: 4,
			Connect: packets.ConnectParams{
				ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 30, ClientIdentifier: "bridge-1",
				UsernameFlag: true, Username: []byte("bridge-1"), PasswordFlag: true, Password: []byte("b1-secret"),
			},
		}
		var buf bytes.Buffer
		require.NoError(t, pk.ConnectEncode(&buf))
		return buf.Bytes()
	}
	_, err = conn.Write(connect())
	require.NoError(t, err)
	connack := make([]byte, 4)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(wait)))
	_, err = io.ReadFull(conn, connack)
	require.NoError(t, err)
	require.Equal(t, []byte{0x20, 2, 0, 0}, connack, "CONNACK accepted")
	_, err = conn.Write(connect())
	require.NoError(t, err)
	_, err = io.Copy(io.Discard, conn) // the broker closes the connection
	require.NoError(t, err)

	testenv.Eventually(t, wait, "the violation logged", func() bool {
		return strings.Contains(logs.String(), "level=WARN")
	})
	secret := []byte("b1-secret")
	asBytes := strings.Trim(fmt.Sprint(secret), "[]")
	assert.Contains(t, logs.String(), "pk=Connect", "the packet told by its kind")
	for _, leak := range []string{"b1-secret", asBytes} {
		assert.NotContains(t, logs.String(), leak, "the password in the log")
	}
}
