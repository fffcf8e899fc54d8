package postgres_test

import (
	"context"
	"log"

	"github.com/devicecompanion/companion/store/postgres"
)

// A server replica opens the store (applying the schema it lacks) and
// listens for the commands other replicas finish. It needs a database, so
// it is compiled, not run.
func ExampleOpen() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := postgres.Open(ctx, "postgres://companion@db.example:5432/companion", postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	listening := make(chan error, 1)
	go func() {
		// id "" after a reconnect: re-read whatever is waited for.
		listening <- s.ListenCommands(ctx, func(id string) { log.Printf("command %s changed", id) })
	}()

	// … serve, until it is time to stop:
	cancel()
	<-listening
}
