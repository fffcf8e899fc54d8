package pahoconn

import (
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/internal/mochitest"
	"github.com/devicecompanion/companion/internal/testenv"
)

// refuseAll refuses every login, and counts them.
type refuseAll struct {
	mochitest.AllowAll
	logins *atomic.Int64
}

func (h *refuseAll) OnConnectAuthenticate(*mochi.Client, packets.Packet) bool {
	h.logins.Add(1)
	return false
}

// lines returns the lines written to w.
func lines(w *testenv.Buffer) []string {
	return strings.Split(strings.TrimSpace(w.String()), "\n")
}

// A client the broker refuses says so, with the broker's reason, once for
// the run of attempts rather than never (paho retries quietly) or once per
// attempt.
func TestReportFailuresLogsARefusal(t *testing.T) {
	var logins atomic.Int64
	_, url := mochitest.Start(t, &refuseAll{logins: &logins})
	var out testenv.Buffer
	o := mqtt.NewClientOptions().AddBroker(url).SetClientID("c").SetUsername("u").SetPassword("wrong").
		SetConnectRetry(true).SetConnectRetryInterval(10 * time.Millisecond)
	c := mqtt.NewClient(ReportFailures(o, slog.New(slog.NewTextHandler(&out, nil)), "check the password"))
	c.Connect()
	testenv.Eventually(t, 20*time.Second, "five refused logins", func() bool { return logins.Load() >= 5 })
	c.Disconnect(0)

	lines := lines(&out)
	if len(lines) != 1 {
		t.Fatalf("logged %d lines for %d refused logins, want 1:\n%s", len(lines), logins.Load(), strings.Join(lines, "\n"))
	}
	for _, want := range []string{"level=WARN", "MQTT connect failed", "attempts=1", "err=", `hint="check the password"`} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("log line %q lacks %q", lines[0], want)
		}
	}
	if strings.Contains(lines[0], `err=""`) || strings.Contains(lines[0], "err=unknown") {
		t.Errorf("log line %q names no reason", lines[0])
	}
}

// The same reason is logged again once a minute with the attempts since,
// another reason at once, and a connection ends the run.
func TestFailureLogRepeats(t *testing.T) {
	var out testenv.Buffer
	log := slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}}))
	var r failureLog
	t0 := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	refused, down := errString("not Authorized"), errString("connection refused")
	r.failed(log, refused, "", t0)
	r.failed(log, refused, "", t0.Add(time.Second))
	r.failed(log, refused, "", t0.Add(30*time.Second))
	r.failed(log, refused, "", t0.Add(61*time.Second)) // a minute on: again, with the two since
	r.failed(log, down, "", t0.Add(62*time.Second))    // another reason
	r.connected()
	r.failed(log, down, "", t0.Add(63*time.Second)) // a new run
	want := []string{
		`level=WARN msg="MQTT connect failed; retrying" err="not Authorized" attempts=1`,
		`level=WARN msg="MQTT connect failed; retrying" err="not Authorized" attempts=3`,
		`level=WARN msg="MQTT connect failed; retrying" err="connection refused" attempts=1`,
		`level=WARN msg="MQTT connect failed; retrying" err="connection refused" attempts=1`,
	}
	got := lines(&out)
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("logged\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

type errString string

func (e errString) Error() string { return string(e) }

// With several brokers, the client says which one it connected to: the
// node it failed over to, not the list.
func TestReportFailuresNamesTheBrokerOfAList(t *testing.T) {
	_, up := mochitest.Start(t, &mochitest.AllowAll{})
	dead := fmt.Sprintf("tcp://127.0.0.1:%d", testenv.FreePort(t)) // nothing listens
	var out testenv.Buffer
	o := mqtt.NewClientOptions().AddBroker(dead).AddBroker(up).SetClientID("c").
		SetConnectRetry(true).SetConnectRetryInterval(10 * time.Millisecond)
	c := mqtt.NewClient(ReportFailures(o, slog.New(slog.NewTextHandler(&out, nil)), "check the password"))
	if tok := c.Connect(); !tok.WaitTimeout(20*time.Second) || tok.Error() != nil {
		t.Fatalf("connect: %v", tok.Error())
	}
	defer c.Disconnect(0)
	testenv.Eventually(t, 10*time.Second, "the connection logged", func() bool {
		return strings.Contains(out.String(), "MQTT connected to a broker of the list")
	})
	for _, l := range lines(&out) {
		if strings.Contains(l, "MQTT connected to a broker of the list") && !strings.Contains(l, "broker="+up) {
			t.Errorf("log line %q does not name %s, the broker that is up", l, up)
		}
	}
}
