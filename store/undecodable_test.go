package store

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"
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

// TestADamagedCommandIsTakenOut damages two of a device's three
// unfinished commands, at its limit of three, and a final one: the list of
// its commands leaves them out, a read of one says it is unreadable and
// whose it is, they no longer count toward the limit, and the device can
// be unbound (past a fourth, damaged since) and purged past them. Each is
// logged once and counted. Without the fix the list and the unbind
// failed, the read was the decode error, the device took no command
// again, and the purge stopped at the first damaged record.
func TestADamagedCommandIsTakenOut(t *testing.T) {
	var logs testenv.Buffer
	now := time.Now()
	clock := now
	db := openTestDBWith(t, t.TempDir()+"/companion.db", Options{Logger: slog.New(slog.NewTextHandler(&logs, nil)), Now: func() time.Time { return clock }})
	ctx := context.Background()
	if err := db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d1", Model: "sim-1"}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: "u1"}); err != nil {
		t.Fatal(err)
	}
	create := func() (companion.Command, error) {
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", UserID: "u1", Op: "push.text", ExpiresAt: now.Add(time.Hour), Blob: strings.Repeat("ab", 32)}, 3, nil)
		return c, err
	}
	ids := map[string]string{}
	for _, name := range []string{"final-damaged", "queued-damaged", "delivered-damaged", "sent"} {
		c, err := create()
		if err != nil {
			t.Fatal(err)
		}
		ids[name] = c.ID
		state := map[string]string{"final-damaged": companion.StateSucceeded, "delivered-damaged": companion.StateDelivered, "sent": companion.StateSent}[name]
		if state != "" {
			if _, err := db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = state; return nil }); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := create(); !errors.Is(err, companion.ErrQueueFull) {
		t.Fatalf("a fourth unfinished command = %v; want ErrQueueFull", err)
	}
	if err := db.bolt.Update(func(tx *bolt.Tx) error {
		for _, name := range []string{"final-damaged", "queued-damaged", "delivered-damaged"} {
			if err := tx.Bucket(bucketCommands).Put([]byte(ids[name]), []byte(`{"id": "`)); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	page, more, err := db.ListCommands(ctx, companion.CommandQuery{DeviceID: "d1", Limit: 10})
	if err != nil || more || len(page) != 1 || page[0].ID != ids["sent"] {
		t.Errorf("ListCommands(d1) = %d commands, %v, %v; want the sent one alone", len(page), more, err)
	}
	c, err := db.Command(ctx, ids["queued-damaged"])
	if !errors.Is(err, companion.ErrUnreadable) || c.ID != ids["queued-damaged"] || c.DeviceID != "d1" {
		t.Errorf("Command(queued-damaged) = %+v, %v; want its id and device, and ErrUnreadable", c, err)
	}
	// The list's read takes the damaged ones out of the unfinished
	// commands, by a write of its own.
	testenv.Eventually(t, 10*time.Second, "the damaged commands no longer counted", func() bool {
		n, err := db.CountOpen(ctx, "d1")
		return err == nil && n == 1
	})
	if n, err := db.CountAllOpen(ctx); n != 1 || err != nil {
		t.Errorf("CountAllOpen = %d, %v; want 1", n, err)
	}
	for _, read := range []func() ([]companion.Command, error){
		func() ([]companion.Command, error) { return db.OpenCommands(ctx) },
		func() ([]companion.Command, error) { return db.ExpiredCommands(ctx, now.Add(2*time.Hour)) },
	} {
		if cmds, err := read(); err != nil || len(cmds) != 1 || cmds[0].ID != ids["sent"] {
			t.Errorf("an open read = %d commands, %v; want the sent one alone", len(cmds), err)
		}
	}
	if err := db.bolt.View(func(tx *bolt.Tx) error {
		if n := tx.Bucket(bucketBlobRefs).Stats().KeyN; n != 1 {
			t.Errorf("%d blob references; want 1, the sent command's", n)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	since, err := create()
	if err != nil {
		t.Fatalf("a command after the damaged ones were taken out = %v", err)
	}
	// Damaged in its turn, it is met first by the unbind's write, which
	// takes it out itself.
	ids["since-damaged"] = since.ID
	if err := db.bolt.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketCommands).Put([]byte(since.ID), []byte(`{"id": "`))
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.UpdateCommand(ctx, ids["delivered-damaged"], func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil }); !errors.Is(err, companion.ErrUnreadable) {
		t.Errorf("a reply to a damaged command = %v; want ErrUnreadable", err)
	}
	if u, err := db.Unbind(ctx, "d1", "u1"); err != nil || len(u.Ended) != 1 || u.Ended[0].ID != ids["sent"] {
		t.Errorf("Unbind(d1) = %d commands ended, %v; want 1, the sent one", len(u.Ended), err)
	}
	if n, err := db.CountAllOpen(ctx); n != 0 || err != nil {
		t.Errorf("after the unbind, CountAllOpen = %d, %v; want 0", n, err)
	}

	clock = now.Add(48 * time.Hour)
	if _, err := db.PurgeCommands(ctx, clock.Add(-time.Hour)); err != nil {
		t.Errorf("PurgeCommands = %v", err)
	}
	for name, id := range ids {
		_, err := db.Command(ctx, id)
		switch want := strings.HasSuffix(name, "-damaged"); {
		case want && !errors.Is(err, companion.ErrUnreadable):
			t.Errorf("after the purge, Command(%s) = %v; want ErrUnreadable (its bytes kept)", name, err)
		case !want && !errors.Is(err, companion.ErrNotFound):
			t.Errorf("after the purge, Command(%s) = %v; want ErrNotFound (purged)", name, err)
		}
	}
	if n := db.Undecodable(); n != 4 {
		t.Errorf("Undecodable() = %d; want 4", n)
	}
	if n := strings.Count(logs.String(), "does not decode is left out"); n != 4 {
		t.Errorf("%d logs of a record that does not decode; want 4, one a record:\n%s", n, logs.String())
	}
}

// TestADamagedBindingIsHealedByTheWritesThatReadIt damages the bindings of
// four devices, each whole in its copy in user_bindings but the last, and
// has each met first by a write that reads it: a command, a move by its
// user, another user's claim, a status report (its event), and the unbind
// of the last. Each reads the binding from its copy and writes it back
// whole; the last is not bound, its records deleted, and is bound again.
// Without the fix each write failed on the decode error (bug 563).
func TestADamagedBindingIsHealedByTheWritesThatReadIt(t *testing.T) {
	var logs testenv.Buffer
	db := openTestDBWith(t, t.TempDir()+"/companion.db", Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	ctx := context.Background()
	devs := []string{"cmd", "move", "claim", "report", "lost"}
	for _, d := range devs {
		if err := db.ProvisionDevice(ctx, companion.RegistryDevice{ID: d, Model: "m"}); err != nil {
			t.Fatal(err)
		}
		if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: d, UserID: "u1"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := db.CreateBridge(ctx, companion.Bridge{ID: "own", OwnerID: "u1", SecretHash: []byte("hash")}); err != nil {
		t.Fatal(err)
	}
	if err := db.bolt.Update(func(tx *bolt.Tx) error {
		for _, d := range devs {
			if err := tx.Bucket(bucketBindings).Put([]byte(d), []byte(`{"device_id": "`+d)); err != nil {
				return err
			}
		}
		return tx.Bucket(bucketUserBindings).Put(key("u1", "lost"), []byte(`{"dev`))
	}); err != nil {
		t.Fatal(err)
	}

	if _, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "cmd", UserID: "u1", Op: "push.text", State: companion.StateQueued, ExpiresAt: time.Now().Add(time.Hour)}, 0, nil); err != nil {
		t.Errorf("CreateCommand(cmd) = %v; want nil", err)
	}
	if _, err := db.AssignDevice(ctx, "move", "own", "u1"); err != nil {
		t.Errorf("AssignDevice(move, own, u1) = %v; want nil", err)
	}
	if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: "claim", UserID: "u2"}); !errors.Is(err, companion.ErrBoundToOther) {
		t.Errorf("Bind(claim, u2) = %v; want ErrBoundToOther", err)
	}
	if _, err := db.PutStatus(ctx, companion.Status{DeviceID: "report", Online: true, LastSeen: time.Now(), Seq: 1}); err != nil {
		t.Errorf("PutStatus(report) = %v; want nil", err)
	}
	if _, err := db.Unbind(ctx, "lost", "u1"); !errors.Is(err, companion.ErrNotFound) {
		t.Errorf("Unbind(lost, u1) = %v; want ErrNotFound", err)
	}

	if err := db.bolt.View(func(tx *bolt.Tx) error {
		for _, d := range devs[:4] {
			var b companion.Binding
			if ok, err := getJSON(tx.Bucket(bucketBindings), []byte(d), &b); err != nil || !ok || b.UserID != "u1" {
				t.Errorf("binding of %s after a write read it = %+v, %v, %v; want u1's, written back", d, b, ok, err)
			}
		}
		if v := tx.Bucket(bucketBindings).Get([]byte("lost")); v != nil {
			t.Errorf("binding of lost = %q; want deleted", v)
		}
		if v := tx.Bucket(bucketUserBindings).Get(key("u1", "lost")); v != nil {
			t.Errorf("copy of lost's binding = %q; want deleted", v)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: "lost", UserID: "u2"}); err != nil {
		t.Errorf("Bind(lost, u2) = %v; want nil", err)
	}
	if got, want := db.Undecodable(), 6; got != want {
		t.Errorf("Undecodable() = %d; want %d\n%s", got, want, logs.String())
	}
}

// TestADamagedReleaseIsLeftOut damages one of two firmware releases of a
// model and one of two releases of an app: every read of the catalog
// leaves the damaged one out (a read of it alone is ErrNotFound), the
// purge of blobs goes on, its publish again replaces it, and each is
// logged once and counted. Without the fix the reads of the model's and
// the app's releases and of the damaged one failed with the decode error,
// its publish too, and every purge of blobs (bug 566).
func TestADamagedReleaseIsLeftOut(t *testing.T) {
	var logs testenv.Buffer
	now := time.Now()
	clock := now
	db := openTestDBWith(t, t.TempDir()+"/companion.db", Options{Logger: slog.New(slog.NewTextHandler(&logs, nil)), Now: func() time.Time { return clock }})
	ctx := context.Background()
	blob := func(content string) string {
		t.Helper()
		b, err := db.PutBlob(ctx, strings.NewReader(content), 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		return b.SHA256
	}
	shas := map[string]string{}
	for _, v := range []string{"1.0.0", "1.1.0"} {
		shas["fw"+v], shas["app"+v] = blob("firmware "+v), blob("app "+v)
		if err := db.PutFirmware(ctx, companion.Firmware{Model: "sim-1", Version: v, SHA256: shas["fw"+v], Size: 12}); err != nil {
			t.Fatal(err)
		}
		if err := db.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: v, SHA256: shas["app"+v], Size: 9}); err != nil {
			t.Fatal(err)
		}
	}
	if err := db.bolt.Update(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketFirmware).Put(key("sim-1", "1.1.0"), []byte(`{"model": "si`)); err != nil {
			return err
		}
		return tx.Bucket(bucketApps).Put(key("clock", "1.1.0"), []byte(`{"app_id": "cl`))
	}); err != nil {
		t.Fatal(err)
	}

	for range 2 {
		fws, err := db.Firmwares(ctx, "sim-1")
		if err != nil || len(fws) != 1 || fws[0].Version != "1.0.0" {
			t.Errorf("Firmwares(sim-1) = %+v, %v; want 1.0.0 alone", fws, err)
		}
		if _, err := db.Firmware(ctx, "sim-1", "1.1.0"); !errors.Is(err, companion.ErrNotFound) {
			t.Errorf("Firmware(sim-1, 1.1.0) = %v; want ErrNotFound", err)
		}
		if f, err := db.Firmware(ctx, "sim-1", "1.0.0"); err != nil || f.SHA256 != shas["fw1.0.0"] {
			t.Errorf("Firmware(sim-1, 1.0.0) = %+v, %v; want it", f, err)
		}
		rs, err := db.AppReleases(ctx, "clock")
		if err != nil || len(rs) != 1 || rs[0].Version != "1.0.0" {
			t.Errorf("AppReleases(clock) = %+v, %v; want 1.0.0 alone", rs, err)
		}
		if _, err := db.AppRelease(ctx, "clock", "1.1.0"); !errors.Is(err, companion.ErrNotFound) {
			t.Errorf("AppRelease(clock, 1.1.0) = %v; want ErrNotFound", err)
		}
		if apps, _, err := db.AppCatalog(ctx, "", 0); err != nil || len(apps) != 1 || !slices.Equal(apps[0].Versions, []string{"1.0.0"}) {
			t.Errorf("AppCatalog = %+v, %v; want clock 1.0.0 alone", apps, err)
		}
	}

	// The purge goes on: the damaged releases' blobs, which nothing else
	// needs, go; the whole releases' stay.
	clock = now.Add(2 * time.Hour)
	if n, err := db.PurgeBlobs(ctx, now.Add(time.Hour)); n != 2 || err != nil {
		t.Errorf("PurgeBlobs = %d, %v; want 2 (the damaged releases' blobs), nil", n, err)
	}
	for name, sha := range shas {
		_, err := db.Blob(ctx, sha)
		switch want := strings.HasSuffix(name, "1.1.0"); {
		case want && !errors.Is(err, companion.ErrNotFound):
			t.Errorf("after the purge, Blob(%s) = %v; want ErrNotFound", name, err)
		case !want && err != nil:
			t.Errorf("after the purge, Blob(%s) = %v; want it kept, released", name, err)
		}
	}

	// Published again, even with other content, the damaged one is
	// replaced; once it decodes, it is not changed.
	for _, v := range []string{"1.1.0", "1.1.0-again"} {
		shas["fw"+v], shas["app"+v] = blob("firmware "+v+" built anew"), blob("app "+v+" built anew")
	}
	if err := db.PutFirmware(ctx, companion.Firmware{Model: "sim-1", Version: "1.1.0", SHA256: shas["fw1.1.0"], Size: 24}); err != nil {
		t.Errorf("PutFirmware(sim-1, 1.1.0) over a damaged record = %v; want nil", err)
	}
	if err := db.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: "1.1.0", SHA256: shas["app1.1.0"], Size: 21}); err != nil {
		t.Errorf("PutAppRelease(clock, 1.1.0) over a damaged record = %v; want nil", err)
	}
	if err := db.PutFirmware(ctx, companion.Firmware{Model: "sim-1", Version: "1.1.0", SHA256: shas["fw1.1.0-again"], Size: 30}); !errors.Is(err, companion.ErrExists) {
		t.Errorf("PutFirmware(sim-1, 1.1.0) with other content, published whole = %v; want ErrExists", err)
	}
	if err := db.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: "1.1.0", SHA256: shas["app1.1.0-again"], Size: 27}); !errors.Is(err, companion.ErrExists) {
		t.Errorf("PutAppRelease(clock, 1.1.0) with other content, published whole = %v; want ErrExists", err)
	}
	if f, err := db.Firmware(ctx, "sim-1", "1.1.0"); err != nil || f.SHA256 != shas["fw1.1.0"] {
		t.Errorf("Firmware(sim-1, 1.1.0) published again = %+v, %v; want the new one", f, err)
	}
	if a, err := db.AppRelease(ctx, "clock", "1.1.0"); err != nil || a.SHA256 != shas["app1.1.0"] {
		t.Errorf("AppRelease(clock, 1.1.0) published again = %+v, %v; want the new one", a, err)
	}
	if rs, err := db.AppReleases(ctx, "clock"); err != nil || len(rs) != 2 {
		t.Errorf("AppReleases(clock) published again = %+v, %v; want both", rs, err)
	}

	if n := db.Undecodable(); n != 2 {
		t.Errorf("Undecodable() = %d; want 2", n)
	}
	if n := strings.Count(logs.String(), "does not decode is left out"); n != 2 {
		t.Errorf("%d logs of a record that does not decode; want 2, one a record:\n%s", n, logs.String())
	}
}

// TestADamagedBlobRecordIsRebuiltOrLeftOut damages the records of five
// blobs: one released, with its file; one whose file is gone too; one
// whose content is stored again; one with an old file and one with a file
// written within the hour, nothing needing either. A damaged record is
// read as rebuilt from its file (its size, and the file's time for when
// it was stored), or as none without a file; storing the content again
// writes it whole; and the purge goes on past each, by the time of its
// file. Without the fix each read of them, the store of the content again
// and every purge failed with their decode error.
func TestADamagedBlobRecordIsRebuiltOrLeftOut(t *testing.T) {
	var logs testenv.Buffer
	now := time.Now()
	clock := now
	db := openTestDBWith(t, t.TempDir()+"/companion.db", Options{Logger: slog.New(slog.NewTextHandler(&logs, nil)), Now: func() time.Time { return clock }})
	ctx := context.Background()
	content := map[string]string{}
	shas := map[string]string{}
	for _, name := range []string{"released", "lost", "again", "old", "fresh"} {
		content[name] = "the content of the " + name + " blob"
		b, err := db.PutBlob(ctx, strings.NewReader(content[name]), 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		shas[name] = b.SHA256
	}
	if err := db.PutFirmware(ctx, companion.Firmware{Model: "sim-1", Version: "1.0.0", SHA256: shas["released"], Size: int64(len(content["released"]))}); err != nil {
		t.Fatal(err)
	}
	if err := db.bolt.Update(func(tx *bolt.Tx) error {
		for _, sha := range shas {
			if err := tx.Bucket(bucketBlobs).Put([]byte(sha), []byte(`{"sha256": "ab`)); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(db.blobPath(shas["lost"])); err != nil {
		t.Fatal(err)
	}
	for name, at := range map[string]time.Time{"released": now.Add(-3 * time.Hour), "old": now.Add(-3 * time.Hour), "fresh": now.Add(90 * time.Minute)} {
		if err := os.Chtimes(db.blobPath(shas[name]), at, at); err != nil {
			t.Fatal(err)
		}
	}

	for range 2 {
		for _, name := range []string{"released", "old", "fresh"} {
			b, err := db.Blob(ctx, shas[name])
			if err != nil || b.SHA256 != shas[name] || b.Size != int64(len(content[name])) {
				t.Errorf("Blob(%s) = %+v, %v; want it rebuilt from its file", name, b, err)
			}
			f, b, err := db.OpenBlob(ctx, shas[name])
			if err != nil {
				t.Errorf("OpenBlob(%s) = %v; want its file", name, err)
				continue
			}
			got, err := io.ReadAll(f)
			f.Close()
			if err != nil || string(got) != content[name] || b.Size != int64(len(got)) {
				t.Errorf("OpenBlob(%s) read %q (size %d), %v; want %q", name, got, b.Size, err, content[name])
			}
		}
		if _, err := db.Blob(ctx, shas["lost"]); !errors.Is(err, companion.ErrNotFound) {
			t.Errorf("Blob(lost) = %v; want ErrNotFound", err)
		}
		if _, _, err := db.OpenBlob(ctx, shas["lost"]); !errors.Is(err, companion.ErrNotFound) {
			t.Errorf("OpenBlob(lost) = %v; want ErrNotFound", err)
		}
	}
	if b, err := db.PutBlob(ctx, strings.NewReader(content["again"]), 1<<20); err != nil || b.SHA256 != shas["again"] {
		t.Errorf("PutBlob(again) over a damaged record = %+v, %v; want it stored", b, err)
	}
	if err := db.bolt.View(func(tx *bolt.Tx) error {
		var rec blobRecord
		return fastjson.Unmarshal(tx.Bucket(bucketBlobs).Get([]byte(shas["again"])), &rec)
	}); err != nil {
		t.Errorf("the record of the blob stored again: %v; want it whole", err)
	}

	// The purge goes on: the record without a file goes, and so do the
	// blobs nothing needs that were stored before the hour, by their
	// record or, damaged, their file's time.
	clock = now.Add(2 * time.Hour)
	if n, err := db.PurgeBlobs(ctx, now.Add(time.Hour)); n != 3 || err != nil {
		t.Errorf("PurgeBlobs = %d, %v; want 3 (the lost, again and old blobs), nil", n, err)
	}
	for name, sha := range shas {
		_, err := db.Blob(ctx, sha)
		_, serr := os.Stat(db.blobPath(sha))
		switch kept := name == "released" || name == "fresh"; {
		case kept && (err != nil || serr != nil):
			t.Errorf("after the purge, Blob(%s) = %v, its file %v; want it kept", name, err, serr)
		case !kept && (!errors.Is(err, companion.ErrNotFound) || !errors.Is(serr, os.ErrNotExist)):
			t.Errorf("after the purge, Blob(%s) = %v, its file %v; want it gone", name, err, serr)
		}
	}

	if n := db.Undecodable(); n != 5 {
		t.Errorf("Undecodable() = %d; want 5", n)
	}
	if n := strings.Count(logs.String(), "does not decode is left out"); n != 5 {
		t.Errorf("%d logs of a record that does not decode; want 5, one a record:\n%s", n, logs.String())
	}
}
