package store

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"

	bolt "go.etcd.io/bbolt"
)

// TestADamagedCommandIsLeftOut damages the records of a queued and a sent
// command: the reads of the outbox and the sweeps return the others, and
// each damaged one is logged once however often it is read. The reads
// failed whole without the fix, and the outbox and the expiry sweep of
// every device with them.
func TestADamagedCommandIsLeftOut(t *testing.T) {
	var logs testenv.Buffer
	db := openTestDBWith(t, t.TempDir()+"/companion.db", Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	ctx := context.Background()
	now := time.Now()
	if _, err := db.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, LastSeen: now, Seq: 1}); err != nil {
		t.Fatal(err)
	}
	ids := map[string]string{}
	for _, name := range []string{"queued-damaged", "queued", "sent-damaged", "sent"} {
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "push.text", State: companion.StateQueued, ExpiresAt: now.Add(-time.Second)}, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		ids[name] = c.ID
		if strings.HasPrefix(name, "sent") {
			if _, err := db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = companion.StateSent; return nil }); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := db.bolt.Update(func(tx *bolt.Tx) error {
		for _, name := range []string{"queued-damaged", "sent-damaged"} {
			if err := tx.Bucket(bucketCommands).Put([]byte(ids[name]), []byte(`{"id": "`)); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	names := func(cmds []companion.Command) []string {
		var out []string
		for _, c := range cmds {
			for name, id := range ids {
				if id == c.ID {
					out = append(out, name)
				}
			}
		}
		slices.Sort(out)
		return out
	}
	reads := []struct {
		what string
		read func() ([]companion.Command, error)
		want []string
	}{
		{"OpenCommands()", func() ([]companion.Command, error) { return db.OpenCommands(ctx) }, []string{"queued", "sent"}},
		{"OpenCommands(queued)", func() ([]companion.Command, error) { return db.OpenCommands(ctx, companion.StateQueued) }, []string{"queued"}},
		{"OpenCommands(sent)", func() ([]companion.Command, error) { return db.OpenCommands(ctx, companion.StateSent) }, []string{"sent"}},
		{"QueuedCommandsWith(d1)", func() ([]companion.Command, error) { return db.QueuedCommandsWith(ctx, []string{"d1"}, nil) }, []string{"queued", "sent"}},
		{"QueuedCommandsWith(skip d9)", func() ([]companion.Command, error) { return db.QueuedCommandsWith(ctx, nil, []string{"d9"}) }, []string{"queued"}},
		{"ExpiredCommands(now)", func() ([]companion.Command, error) { return db.ExpiredCommands(ctx, now) }, []string{"queued", "sent"}},
		{"SentCommandsOnline()", func() ([]companion.Command, error) { return db.SentCommandsOnline(ctx) }, []string{"sent"}},
	}
	for range 2 {
		for _, r := range reads {
			cmds, err := r.read()
			if got := names(cmds); err != nil || !slices.Equal(got, r.want) {
				t.Errorf("%s = %q, %v; want %q", r.what, got, err, r.want)
			}
		}
	}
	if n := strings.Count(logs.String(), "does not decode"); n != 2 {
		t.Errorf("%d logs of a record that does not decode; want 2, one a record:\n%s", n, logs.String())
	}
}
