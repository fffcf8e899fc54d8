package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/nats-io/nkeys"

	"github.com/devicecompanion/companion/broker/natsauth"
	"github.com/devicecompanion/companion/internal/tlsclient"
	"github.com/devicecompanion/companion/topics"
)

// NATSConfig is the server's side of a NATS cluster's auth callout
// (docs/scale-out.md): with URL set, the server answers the cluster's
// authorization of MQTT clients (broker/natsauth).
type NATSConfig struct {
	// URL is the cluster's NATS client URL, or a comma-separated list of
	// its nodes; "" leaves NATS's authorization to its configuration.
	URL string
	// User and Password log in as one of auth_callout's auth_users.
	User, Password string
	// SystemUser and SystemPassword log in to the system account, to
	// close the connections whose rights change.
	SystemUser, SystemPassword string
	// IssuerSeedFile holds the account nkey seed (SA…) whose public key is
	// auth_callout's issuer.
	IssuerSeedFile string
	// Account is the NATS account MQTT clients are placed in.
	Account string
}

func addNATSFlags(fs *flag.FlagSet, c *NATSConfig) {
	fs.StringVar(&c.URL, "nats-callout", "", "answer the authorization of this NATS cluster's MQTT clients (auth callout): its NATS client URL, or a comma-separated list of its nodes; needs --mqtt-url on the same cluster and turns --mqtt-dynsec off")
	fs.StringVar(&c.User, "nats-callout-user", "", "with --nats-callout: the NATS user (one of auth_callout's auth_users) the server answers as")
	fs.StringVar(&c.Password, "nats-callout-password", "", "password of --nats-callout-user")
	fs.StringVar(&c.SystemUser, "nats-system-user", "", "with --nats-callout: a user of NATS's system account, to close the connections whose rights change")
	fs.StringVar(&c.SystemPassword, "nats-system-password", "", "password of --nats-system-user")
	fs.StringVar(&c.IssuerSeedFile, "nats-issuer-seed", "", "with --nats-callout: file holding the account nkey seed (SA…) whose public key is auth_callout's issuer")
	fs.StringVar(&c.Account, "nats-account", natsauth.DefaultAccount, "with --nats-callout: the NATS account (with JetStream) MQTT clients are placed in")
}

// startNATSAuth starts the auth callout responder when --nats-callout is
// set. The server's own MQTT account is --mqtt-username/--mqtt-password.
func (m *Main) startNATSAuth(tree topics.Tree) error {
	cfg := m.Config
	c := cfg.NATS
	if c.URL == "" {
		return nil
	}
	switch {
	case cfg.MQTTURL == "":
		return usageError{"--nats-callout needs --mqtt-url (the MQTT listeners of the same NATS cluster)"}
	case cfg.MQTTUsername == "" || cfg.MQTTPassword == "":
		return usageError{"--nats-callout needs --mqtt-username and --mqtt-password: the server's own account, which the callout grants"}
	case c.User == "" || c.Password == "":
		return usageError{"--nats-callout needs --nats-callout-user and --nats-callout-password"}
	case c.SystemUser == "" || c.SystemPassword == "":
		return usageError{"--nats-callout needs --nats-system-user and --nats-system-password, to close the connections whose rights change"}
	case c.IssuerSeedFile == "":
		return usageError{"--nats-callout needs --nats-issuer-seed"}
	}
	// A seed that cannot be read or parsed is a usage error (exit
	// status 2), which systemd does not restart (bug 404).
	seed, err := os.ReadFile(c.IssuerSeedFile)
	if err != nil {
		return usageError{fmt.Sprintf("--nats-issuer-seed: %v", err)}
	}
	issuer, err := nkeys.ParseDecoratedNKey(seed)
	if err != nil {
		return usageError{fmt.Sprintf("--nats-issuer-seed %s: %v", c.IssuerSeedFile, err)}
	}
	natsOpts := natsauth.Options{
		URL:  c.URL,
		User: c.User, Password: c.Password,
		SystemUser: c.SystemUser, SystemPassword: c.SystemPassword,
		Issuer:         issuer,
		Account:        c.Account,
		Store:          m.DB,
		ServerUsername: cfg.MQTTUsername,
		ServerPassword: cfg.MQTTPassword,
		Topics:         tree,
		Logger:         m.Logger,
	}
	if tlsclient.IsTLSURL(c.URL) {
		if natsOpts.TLSConfig, err = tlsclient.Config(cfg.MQTTCA); err != nil {
			return usageError{fmt.Sprintf("--mqtt-ca: %v", err)}
		}
	}
	m.NATSAuth, err = natsauth.New(natsOpts)
	if err != nil {
		return err
	}
	if cfg.MQTTDynsec {
		m.Logger.Info("--nats-callout answers the broker's authorization: --mqtt-dynsec is off")
	}
	return nil
}
