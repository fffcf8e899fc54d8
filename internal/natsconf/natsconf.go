// Package natsconf writes the configuration of the NATS Server nodes of
// CONTRACT §11's cluster: JetStream, the routes between the nodes, MQTT,
// and the door, either static users or the auth callout that
// `companion serve --nats-callout` answers (broker/natsauth,
// docs/scale-out.md). internal/natstest (the tests' cluster) and
// scripts/cluster (make cluster) both write their nodes' files with it, so
// that what the tests prove is what people try.
//
// It only writes text: it starts nothing and knows nothing of the
// companion server's flags.
package natsconf

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nkeys"
)

// DefaultMaxAckPending is the mqtt.max_ack_pending Config writes unless
// told otherwise: how many QoS 1 messages NATS sends one MQTT subscription
// before it waits for their PUBACKs. NATS's own default is 1,024, and a
// session's subscriptions may have at most 65,535 together, so a bridge,
// which subscribes once for each device it serves, would get a 64th
// device's commands refused (SUBACK 0x80). With 64, one session holds
// 65,535 / 64 = 1,023 QoS 1 subscriptions (docs/scale-out.md).
const DefaultMaxAckPending = 64

// The accounts of a callout configuration: the callout's own (where NATS
// sends its requests) and the system account.
const (
	AuthAccount   = "AUTH"
	SystemAccount = "SYS"
)

// Node is one NATS Server of the cluster, on 127.0.0.1.
type Node struct {
	// Name is its server_name (nats-1, …).
	Name string
	// Client, Route, MQTT and Monitor are its ports: NATS clients, routes
	// from the other nodes, MQTT and HTTP monitoring.
	Client, Route, MQTT, Monitor int
	// StoreDir is its JetStream directory.
	StoreDir string
}

// User is a static NATS user. Publish and Subscribe are NATS subjects
// (natsauth.Subjects turns MQTT filters into them); an empty Publish
// allows no publish. Every user may subscribe to "$MQTT.sub.>", the
// subjects of QoS 1 and 2 deliveries (implicit from NATS 2.12.3,
// required before).
type User struct {
	Name, Password     string
	Publish, Subscribe []string
}

// Callout is the auth callout block and the accounts it needs:
//
//	accounts {
//	  AUTH: { users: [ {user: User, password: Password} ] }
//	  SYS: { users: [ {user: SystemUser, password: SystemPassword} ] }
//	  Account: { jetstream: enabled, users: [ Config.Users ] }
//	}
//	system_account: SYS
//	authorization {
//	  timeout: 5
//	  auth_callout { issuer: Issuer, account: AUTH, auth_users: [ User, SystemUser, Config.Users ] }
//	}
//
// These are what `companion serve` takes as --nats-callout-user and
// --nats-callout-password, --nats-system-user and --nats-system-password,
// --nats-issuer-seed (the seed of Issuer) and --nats-account.
type Callout struct {
	User, Password             string
	SystemUser, SystemPassword string
	// Issuer is the public key of the account nkey that signs the
	// callout's answers (NewIssuer makes one).
	Issuer string
	// Account is where the callout places MQTT clients; it has JetStream.
	Account string
}

// Config is the cluster's configuration; Node writes one node's file.
type Config struct {
	// Comment is the file's first line, after "# ".
	Comment string
	// ClusterName is the cluster block's name.
	ClusterName string
	Nodes       []Node
	// AckWait is mqtt.ack_wait: how long a QoS 1 message sent to a
	// subscriber waits for its PUBACK before it is sent again. Zero keeps
	// NATS's default (30s).
	AckWait time.Duration
	// MaxAckPending is mqtt.max_ack_pending; zero means
	// DefaultMaxAckPending, a negative value NATS's default (1,024).
	MaxAckPending int
	// Debug turns NATS's debug logging on.
	Debug bool
	// Users are static users: with Callout, of Callout.Account and let in
	// without asking the callout; without, the whole door.
	Users []User
	// Callout, when set, sends every other login to the auth callout.
	Callout *Callout
}

// NewIssuer makes an account nkey for the callout's issuer: its seed
// (SA…, the file --nats-issuer-seed names) and its public key
// (Callout.Issuer).
func NewIssuer() (seed []byte, public string, err error) {
	kp, err := nkeys.CreateAccount()
	if err != nil {
		return nil, "", err
	}
	if seed, err = kp.Seed(); err != nil {
		return nil, "", err
	}
	if public, err = kp.PublicKey(); err != nil {
		return nil, "", err
	}
	return seed, public, nil
}

// Node returns node i's configuration file.
func (c Config) Node(i int) (string, error) {
	if i < 0 || i >= len(c.Nodes) {
		return "", fmt.Errorf("natsconf: no node %d of %d", i, len(c.Nodes))
	}
	if c.MaxAckPending > 0xFFFF {
		return "", fmt.Errorf("natsconf: max_ack_pending %d: at most 65535", c.MaxAckPending)
	}
	w := &writer{}
	n := c.Nodes[i]
	w.printf("# %s\n", c.Comment)
	w.printf("server_name: %s\n", w.quote(n.Name))
	w.printf("listen: 127.0.0.1:%d\n", n.Client)
	w.printf("http: 127.0.0.1:%d\n", n.Monitor)
	if c.Debug {
		w.printf("debug: true\n")
	}

	w.printf("\njetstream {\n")
	w.printf("  store_dir: %s\n", w.quote(n.StoreDir))
	w.printf("  max_memory_store: 64MB\n  max_file_store: 1GB\n}\n")

	var routes []string
	for j, o := range c.Nodes {
		if j != i {
			routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", o.Route))
		}
	}
	w.printf("\ncluster {\n  name: %s\n", w.quote(c.ClusterName))
	w.printf("  listen: 127.0.0.1:%d\n", n.Route)
	w.printf("  routes: %s\n}\n", w.quoteAll(routes))

	w.printf("\nmqtt {\n")
	w.printf("  listen: 127.0.0.1:%d\n", n.MQTT)
	// Sessions, retained messages and QoS 1 messages in flight live in
	// JetStream streams; a replica on every node keeps them through the
	// loss of one. Their consumers take the stream's replicas (NATS 2.15
	// ignores consumer_replicas and warns about it, so it is not written).
	w.printf("  stream_replicas: %d\n", len(c.Nodes))
	if c.AckWait > 0 {
		// A QoS 1 message whose PUBACK was lost with a node comes again
		// after this (docs/scale-out.md).
		w.printf("  ack_wait: %s\n", w.quote(c.AckWait.String()))
	}
	switch {
	case c.MaxAckPending == 0:
		w.printf("  max_ack_pending: %d\n", DefaultMaxAckPending)
	case c.MaxAckPending > 0:
		w.printf("  max_ack_pending: %d\n", c.MaxAckPending)
	}
	w.printf("}\n")

	if c.Callout == nil {
		w.printf("\nauthorization {\n  users: [\n")
		w.users(c.Users, "    ")
		w.printf("  ]\n}\n")
		return w.result()
	}
	co := c.Callout
	if co.User == "" || co.SystemUser == "" || co.Issuer == "" || co.Account == "" {
		return "", fmt.Errorf("natsconf: a callout needs its user, a system user, an issuer and an account")
	}
	if strings.Trim(co.Account, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-") != "" {
		return "", fmt.Errorf("natsconf: account %q: letters, digits, _ and - only", co.Account)
	}
	w.printf("\naccounts {\n")
	w.printf("  %s: { users: [ { user: %s, password: %s } ] }\n", AuthAccount, w.quote(co.User), w.quote(co.Password))
	w.printf("  %s: { users: [ { user: %s, password: %s } ] }\n", SystemAccount, w.quote(co.SystemUser), w.quote(co.SystemPassword))
	w.printf("  %s: {\n    jetstream: enabled\n    users: [\n", co.Account)
	w.users(c.Users, "      ")
	w.printf("    ]\n  }\n}\n")
	w.printf("system_account: %s\n", SystemAccount)
	authUsers := []string{co.User, co.SystemUser}
	for _, u := range c.Users {
		authUsers = append(authUsers, u.Name)
	}
	// The service has five seconds to answer, not NATS's two: a bridge of
	// a thousand devices takes a while on a busy machine.
	w.printf("\nauthorization {\n  timeout: 5\n  auth_callout {\n")
	w.printf("    issuer: %s\n    account: %s\n    auth_users: %s\n", w.quote(co.Issuer), AuthAccount, w.quoteAll(authUsers))
	w.printf("  }\n}\n")
	return w.result()
}

// writer builds a file and keeps the first error.
type writer struct {
	b   strings.Builder
	err error
}

func (w *writer) printf(format string, args ...any) { fmt.Fprintf(&w.b, format, args...) }

func (w *writer) result() (string, error) {
	if w.err != nil {
		return "", w.err
	}
	return w.b.String(), nil
}

// users writes the entries of a users list.
func (w *writer) users(users []User, indent string) {
	for _, u := range users {
		w.printf("%s{\n%s  user: %s\n%s  password: %s\n", indent, indent, w.quote(u.Name), indent, w.quote(u.Password))
		w.printf("%s  permissions: {\n", indent)
		if len(u.Publish) > 0 {
			w.printf("%s    publish: { allow: %s }\n", indent, w.quoteAll(u.Publish))
		} else {
			// An empty allow list would allow everything.
			w.printf("%s    publish: { deny: [\">\"] }\n", indent)
		}
		sub := append(append([]string(nil), u.Subscribe...), "$MQTT.sub.>")
		w.printf("%s    subscribe: { allow: %s }\n", indent, w.quoteAll(sub))
		w.printf("%s  }\n%s}\n", indent, indent)
	}
}

// quote returns s as a double-quoted string of NATS's configuration
// language, which takes printable ASCII only here.
func (w *writer) quote(s string) string {
	for _, r := range s {
		if r < 0x20 || r > 0x7e {
			if w.err == nil {
				w.err = fmt.Errorf("natsconf: %q: only printable ASCII is written to a NATS configuration", s)
			}
			return `""`
		}
	}
	return strconv.Quote(s) // printable ASCII: only \ and " are escaped
}

func (w *writer) quoteAll(ss []string) string {
	q := make([]string, len(ss))
	for i, s := range ss {
		q[i] = w.quote(s)
	}
	return "[" + strings.Join(q, ", ") + "]"
}

// CheckString reports whether s can be written to a configuration: what
// Node refuses, for callers that check their input first.
func CheckString(s string) error {
	w := &writer{}
	w.quote(s)
	return w.err
}
