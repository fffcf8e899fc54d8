package agent_test

import (
	"context"
	"log"
	"os/signal"
	"syscall"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/sim"
)

// A bridge for two simulated devices, run until SIGINT or SIGTERM.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	a, err := agent.New(agent.Options{
		MQTTURL:  "tcp://127.0.0.1:1883",
		BridgeID: "kitchen",
		Password: "the secret from companion bridge create",
		APIURL:   "http://127.0.0.1:8080",
		DataDir:  "./bridge-data",
		Devices:  []agent.Device{sim.New(sim.Options{ID: "dev-1"}), sim.New(sim.Options{ID: "dev-2"})},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer a.Close()
	if err := a.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
