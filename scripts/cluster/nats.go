package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/devicecompanion/companion/broker/natsauth"
	"github.com/devicecompanion/companion/internal/natsconf"
)

// natsNode is one NATS Server of the cluster, named nats-N, with its four
// ports on 127.0.0.1: clients, routes to the other nodes, MQTT and
// monitoring.
type natsNode struct {
	name                         string
	client, route, mqtt, monitor int
}

func (c *cluster) natsConfPath(i int) string { return filepath.Join(c.dir, c.nats[i].name+".conf") }

// natsConfig is the nodes' configuration (internal/natsconf, which the
// tests' clusters are written with too): JetStream (MQTT keeps its
// sessions, retained messages and QoS 1 messages in flight there, three
// replicas each so that they survive the loss of a node), the routes
// between the nodes, MQTT, and the door.
func (c *cluster) natsConfig() natsconf.Config {
	cfg := natsconf.Config{
		Comment:     "Written by scripts/cluster (make cluster).",
		ClusterName: "companion",
		// A QoS 1 message whose PUBACK was lost with a node comes again
		// after this; NATS's default is 30s (docs/scale-out.md).
		AckWait: 5 * time.Second,
		Callout: c.door.callout(),
	}
	for _, n := range c.nats {
		cfg.Nodes = append(cfg.Nodes, natsconf.Node{
			Name:   n.name,
			Client: n.client, Route: n.route, MQTT: n.mqtt, Monitor: n.monitor,
			StoreDir: filepath.Join(c.dir, n.name),
		})
	}
	return cfg
}

// writeNATSConfigs writes every node's configuration.
func (c *cluster) writeNATSConfigs() error {
	cfg := c.natsConfig()
	for i := range c.nats {
		conf, err := cfg.Node(i)
		if err != nil {
			return err
		}
		// 0600: it holds passwords.
		if err := os.WriteFile(c.natsConfPath(i), []byte(conf), 0o600); err != nil {
			return err
		}
	}
	return nil
}

// startNATS starts the three nodes and waits until each reports itself
// healthy (JetStream on, its meta leader elected: only once all three
// run). Whether MQTT serves is seen later, by the replicas' /readyz.
func (c *cluster) startNATS(ctx context.Context) error {
	if err := c.writeNATSConfigs(); err != nil {
		return err
	}
	var ps []*proc
	for i, n := range c.nats {
		p, err := c.spawn(n.name, nil, filepath.Join(c.bin, "nats-server"), "-c", c.natsConfPath(i))
		if err != nil {
			return err
		}
		ps = append(ps, p)
	}
	mon := c.monitorURLs()
	for i, p := range ps {
		if err := c.waitFor(ctx, p, p.name+" healthy", func() error { return getOK(mon[i] + "/healthz") }); err != nil {
			return err
		}
	}
	return nil
}

// natsClientConnected says whether MQTT client id is connected to any node.
func (c *cluster) natsClientConnected(id string) error {
	return mqttClientConnected(c.monitorURLs(), id)
}

// mqttClientConnected says whether MQTT client id is connected to any of
// the nodes whose monitoring URLs are monitors.
func mqttClientConnected(monitors []string, id string) error {
	for _, mon := range monitors {
		resp, err := httpClient.Get(mon + "/connz?mqtt_client=" + url.QueryEscape(id))
		if err != nil {
			return err
		}
		var cz struct {
			Conns []struct {
				MQTTClient string `json:"mqtt_client"`
			} `json:"connections"`
		}
		err = json.NewDecoder(resp.Body).Decode(&cz)
		resp.Body.Close()
		if err != nil {
			return err
		}
		for _, cn := range cz.Conns {
			if cn.MQTTClient == id {
				return nil
			}
		}
	}
	return fmt.Errorf("MQTT client %s is connected to no node", id)
}

// door is who may do what on the NATS nodes (CONTRACT §3 and §9): the
// replicas answer the nodes' authorization (`companion serve
// --nats-callout`, broker/natsauth), from the store, so a bridge made
// through the admin API logs in with its secret and gets its devices'
// rights at once, and nothing is written into the nodes for it. The nodes
// know the replicas' own login to the callout's account, a user of the
// system account (to close the connections whose rights change) and the
// public key of the issuer, whose seed the replicas sign with.
type door struct {
	server                     struct{ name, password string } // the replicas' MQTT account, granted by the callout
	authUser, authPassword     string
	systemUser, systemPassword string
	issuer                     string // the public key
	seedPath                   string // DIR/issuer.nk, the seed, mode 0600
	natsURL                    string // the nodes' client URLs, comma-separated
}

// newDoor makes the door's passwords and issuer key, and writes the
// issuer's seed under dir.
func newDoor(dir string, clientURLs []string) (*door, error) {
	seed, pub, err := natsconf.NewIssuer()
	if err != nil {
		return nil, err
	}
	d := &door{
		authUser: "companion-auth", authPassword: randomString(18),
		systemUser: "companion-sys", systemPassword: randomString(18),
		issuer:   pub,
		seedPath: filepath.Join(dir, "issuer.nk"),
		natsURL:  strings.Join(clientURLs, ","),
	}
	d.server.name, d.server.password = "companion-server", randomString(18)
	if err := os.WriteFile(d.seedPath, seed, 0o600); err != nil {
		return nil, err
	}
	return d, nil
}

// callout is the nodes' side of the door.
func (d *door) callout() *natsconf.Callout {
	return &natsconf.Callout{
		User: d.authUser, Password: d.authPassword,
		SystemUser: d.systemUser, SystemPassword: d.systemPassword,
		Issuer:  d.issuer,
		Account: natsauth.DefaultAccount,
	}
}

// serverFlags are the replicas' flags for the door: their own MQTT
// account, which their callout grants, and the callout's.
func (d *door) serverFlags() []string {
	return []string{
		"--mqtt-username", d.server.name, "--mqtt-password", d.server.password,
		"--mqtt-dynsec=false", // NATS has none; --nats-callout turns it off anyway
		"--nats-callout", d.natsURL,
		"--nats-callout-user", d.authUser, "--nats-callout-password", d.authPassword,
		"--nats-system-user", d.systemUser, "--nats-system-password", d.systemPassword,
		"--nats-issuer-seed", d.seedPath,
		"--nats-account", natsauth.DefaultAccount,
	}
}
