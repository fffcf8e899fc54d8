package natsconf_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/natsconf"
	"github.com/devicecompanion/companion/internal/testenv"
)

func testConfig(t *testing.T) natsconf.Config {
	dir := t.TempDir()
	cfg := natsconf.Config{Comment: "test", ClusterName: "test", AckWait: 5 * time.Second}
	for i, name := range []string{"nats-1", "nats-2", "nats-3"} {
		base := 10000 + 10*i // not bound: nats-server -t only reads the file
		cfg.Nodes = append(cfg.Nodes, natsconf.Node{Name: name, Client: base, Route: base + 1, MQTT: base + 2, Monitor: base + 3, StoreDir: filepath.Join(dir, name)})
	}
	cfg.Users = []natsconf.User{{Name: "probe", Password: `p"w\`, Publish: []string{"a.>"}, Subscribe: []string{"a.>", "a"}}}
	return cfg
}

// Both doors, as written, are configurations NATS Server takes (nats-server
// -t), with the MQTT settings the service relies on.
func TestNodeAcceptedByNATS(t *testing.T) {
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(root, "bin", "nats-server")
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("%s is missing: run make deps", bin)
	}
	seed, issuer, err := natsconf.NewIssuer()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(seed), "SA") || !strings.HasPrefix(issuer, "A") {
		t.Errorf("NewIssuer() = %.2s…, %.1s…; want an account seed (SA…) and key (A…)", seed, issuer)
	}
	static := testConfig(t)
	callout := testConfig(t)
	callout.MaxAckPending = -1
	callout.Callout = &natsconf.Callout{User: "auth", Password: "a", SystemUser: "sys", SystemPassword: "s", Issuer: issuer, Account: "COMPANION"}
	for _, tc := range []struct {
		name string
		cfg  natsconf.Config
		want []string
		not  []string
	}{
		{"static", static, []string{"max_ack_pending: 64", `ack_wait: "5s"`, "stream_replicas: 3", `"nats-route://127.0.0.1:10011"`, `"$MQTT.sub.>"`}, []string{"auth_callout"}},
		{"callout", callout, []string{"auth_callout", "issuer: \"" + issuer + "\"", `auth_users: ["auth", "sys", "probe"]`, "system_account: SYS"}, []string{"max_ack_pending"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conf, err := tc.cfg.Node(0)
			if err != nil {
				t.Fatalf("Node(0): %v", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(conf, w) {
					t.Errorf("Node(0) lacks %q:\n%s", w, conf)
				}
			}
			for _, w := range tc.not {
				if strings.Contains(conf, w) {
					t.Errorf("Node(0) has %q:\n%s", w, conf)
				}
			}
			path := filepath.Join(t.TempDir(), "nats.conf")
			if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
				t.Fatal(err)
			}
			if out, err := exec.Command(bin, "-t", "-c", path).CombinedOutput(); err != nil {
				t.Errorf("nats-server -t: %v\n%s\n%s", err, out, conf)
			}
		})
	}
}

func TestNodeRefuses(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*natsconf.Config)
	}{
		{"no such node", func(c *natsconf.Config) { c.Nodes = c.Nodes[:0] }},
		{"not ASCII", func(c *natsconf.Config) { c.Users[0].Password = "pässword" }},
		{"max_ack_pending", func(c *natsconf.Config) { c.MaxAckPending = 70000 }},
		{"callout without issuer", func(c *natsconf.Config) { c.Callout = &natsconf.Callout{User: "a", SystemUser: "s", Account: "X"} }},
		{"account name", func(c *natsconf.Config) {
			c.Callout = &natsconf.Callout{User: "a", SystemUser: "s", Issuer: "A", Account: "X }"}
		}},
	} {
		cfg := testConfig(t)
		tc.edit(&cfg)
		if conf, err := cfg.Node(0); err == nil {
			t.Errorf("%s: Node(0) = nil error; want one:\n%s", tc.name, conf)
		}
	}
}
