package natsauth_test

import (
	"log"
	"os"

	"github.com/nats-io/nkeys"

	"github.com/devicecompanion/companion/broker/natsauth"
	"github.com/devicecompanion/companion/store"
)

// The server's wiring, as `companion serve --nats-callout` does it: the
// responder answers the cluster's logins from the store, and is what the
// API tells of changes (api.Options.BrokerAccounts).
func ExampleNew() {
	seed, err := os.ReadFile("/etc/companion/issuer.nk") // SA…, mode 0600
	if err != nil {
		log.Fatal(err)
	}
	issuer, err := nkeys.ParseDecoratedNKey(seed)
	if err != nil {
		log.Fatal(err)
	}
	db, err := store.Open("/var/lib/companion/companion.db", store.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	r, err := natsauth.New(natsauth.Options{
		URL:  "nats://n1:4222,nats://n2:4222,nats://n3:4222",
		User: "companion-auth", Password: os.Getenv("NATS_CALLOUT_PASSWORD"),
		SystemUser: "companion-sys", SystemPassword: os.Getenv("NATS_SYSTEM_PASSWORD"),
		Issuer:         issuer,
		Store:          db,
		ServerUsername: "companion-server", ServerPassword: os.Getenv("MQTT_PASSWORD"),
	})
	if err != nil {
		log.Fatal(err)
	}
	defer r.Close()
}
