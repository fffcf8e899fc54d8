package main

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
)

// docShellBlock returns the lines of the first sh block under heading in
// the repository's file rel.
func docShellBlock(tb testing.TB, rel, heading string) []string {
	tb.Helper()
	var lines []string
	under, in := false, false
	sc := bufio.NewScanner(strings.NewReader(string(testenv.ReadRepoFile(tb, rel))))
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, "#") && !in:
			under = l == heading
		case under && !in && l == "```sh":
			in = true
		case in && l == "```":
			return lines
		case in:
			lines = append(lines, l)
		}
	}
	tb.Fatalf("%s has no sh block under %q", rel, heading)
	return nil
}

// TestMosquittoDocAccountsWork runs docs/mosquitto.md's section 2, the
// server's account, as printed: mosquitto_ctrl dynsec init into the
// plugin's file, Mosquitto started from mosquitto.conf, the role the
// mosquitto_ctrl lines make; then the server logs in with that account and
// makes the rest, and every operation runs through a bridge. Only what
// belongs to the machine is changed: the file's path (the test's Mosquitto
// keeps it in its own directory), the chown and the systemctl line (the
// test starts Mosquitto itself, as its own user) and the port. The other
// Mosquitto tests make the account their own way (internal/mqtttest), as
// init does.
func TestMosquittoDocAccountsWork(t *testing.T) {
	t.Parallel()
	const docFile = "/var/lib/mosquitto/dynamic-security.json"
	lines := docShellBlock(t, "docs/mosquitto.md", "## 2. Accounts")
	var before, after []string
	var account string
	restarted := false
	for _, l := range lines {
		switch {
		case l == "systemctl restart mosquitto":
			restarted = true
			continue
		case strings.HasPrefix(l, "chown "):
			continue
		case strings.HasPrefix(l, "mosquitto_ctrl dynsec init "+docFile+" "):
			account = strings.Fields(l)[4]
		}
		if restarted {
			after = append(after, l)
		} else {
			before = append(before, l)
		}
	}
	require.True(t, restarted, "docs/mosquitto.md, section 2, restarts Mosquitto after init: %q", lines)
	require.NotEmpty(t, account, "docs/mosquitto.md, section 2, runs mosquitto_ctrl dynsec init %s ACCOUNT", docFile)

	passFile := filepath.Join(t.TempDir(), "pass")
	mq := mqtttest.StartMosquittoInit(t, func(path string) error {
		script := strings.ReplaceAll(strings.Join(before, "\n"), docFile, path) + "\nprintf %s \"$PASS\" >" + passFile + "\n"
		out, err := exec.Command("sh", "-ec", script).CombinedOutput()
		require.NoError(t, err, "%s\n%s", script, out)
		return nil
	})
	pass, err := os.ReadFile(passFile)
	require.NoError(t, err)
	require.NotEmpty(t, pass, "the doc's PASS")

	prelude := "PASS='" + string(pass) + "'\n"
	const host = "-h 127.0.0.1 "
	for _, l := range after {
		if strings.HasPrefix(l, "C=") {
			require.Contains(t, l, host, "the doc's mosquitto_ctrl line")
			prelude += strings.Replace(l, host, host+"-p "+strconv.Itoa(mq.Port)+" ", 1) + "\n"
			continue
		}
		out, err := exec.Command("sh", "-c", prelude+l).CombinedOutput()
		if strings.Contains(l, " addClientRole ") {
			// The doc: it disconnects mosquitto_ctrl itself, so it may
			// report no answer although the change is made.
			t.Logf("%s: %v\n%s", l, err, out)
			continue
		}
		require.NoError(t, err, "%s\n%s", l, out)
		require.NotContains(t, string(out), "Error", "%s", l)
	}
	// "$C getClient companion-server shows it": a line of its roles.
	role := regexp.MustCompile(`(?m)^(Roles:)?\s+` + regexp.QuoteMeta(account) + ` \(priority`)
	testenv.Eventually(t, 10*time.Second, "the doc's getClient to show the account's role "+account, func() bool {
		out, _ := exec.Command("sh", "-c", prelude+"$C getClient "+account).CombinedOutput()
		return role.Match(out)
	})

	m := startServer(t, Config{Data: t.TempDir(), MQTTURL: mq.URL, MQTTUsername: account, MQTTPassword: string(pass), MQTTDynsec: true})
	testenv.Eventually(t, 20*time.Second, "the server connected to Mosquitto", m.Broker.Ready)
	f := setupFleet(t, m, "dev-1")
	b := startBridge(t, m, mq.URL, f, "", "dev-1")
	exerciseEveryOperation(t, f, b, "dev-1")
}
