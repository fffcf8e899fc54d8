package store

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
)

// provision adds devices with the model to the registry.
func provision(tb testing.TB, db *DB, model string, ids ...string) {
	tb.Helper()
	for _, id := range ids {
		mustNil(tb, "ProvisionDevice("+id+")", db.ProvisionDevice(context.Background(), companion.RegistryDevice{ID: id, Model: model, ClaimHash: hashOf(id)}))
	}
}

func TestBind(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	provision(t, db, "sim-1", "d1", "d2")
	fixed := time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC)

	tests := []struct {
		name        string
		b           companion.Binding
		wantCreated bool
		wantName    string
		wantBoundAt time.Time
		want        error
	}{
		{"new binding", companion.Binding{DeviceID: "d1", UserID: "u1", Name: "desk", Model: "ignored"}, true, "desk", clock.Now(), nil},
		{"same user again", companion.Binding{DeviceID: "d1", UserID: "u1", Name: "other name"}, false, "desk", clock.Now(), nil},
		{"other user", companion.Binding{DeviceID: "d1", UserID: "u2"}, false, "", time.Time{}, companion.ErrBoundToOther},
		{"not provisioned", companion.Binding{DeviceID: "d9", UserID: "u1"}, false, "", time.Time{}, companion.ErrNotFound},
		{"given BoundAt", companion.Binding{DeviceID: "d2", UserID: "u2", BoundAt: fixed}, true, "", fixed, nil},
		{"no user", companion.Binding{DeviceID: "d2"}, false, "", time.Time{}, companion.ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, created, err := db.Bind(ctx, tt.b)
			wantErr(t, "Bind", err, tt.want)
			if created != tt.wantCreated {
				t.Errorf("Bind(%+v) created = %v; want %v", tt.b, created, tt.wantCreated)
			}
			if err != nil {
				return
			}
			if got.Name != tt.wantName || got.Model != "sim-1" || !got.BoundAt.Equal(tt.wantBoundAt) {
				t.Errorf("Bind(%+v) = %+v; want name %q, model sim-1, bound at %v", tt.b, got, tt.wantName, tt.wantBoundAt)
			}
		})
	}

	b, err := db.Binding(ctx, "d1")
	if err != nil || b.UserID != "u1" || b.Model != "sim-1" {
		t.Errorf("Binding(d1) = %+v, %v", b, err)
	}
	_, err = db.Binding(ctx, "d9")
	wantErr(t, "Binding(d9)", err, companion.ErrNotFound)
}

func TestBindConcurrentOneWinner(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	provision(t, db, "sim-1", "d1")
	const n = 20
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		created int
		others  int
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, c, err := db.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: fmt.Sprintf("u%d", i)})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case c:
				created++
			case err == companion.ErrBoundToOther:
				others++
			default:
				t.Errorf("Bind = %v, %v", c, err)
			}
		}()
	}
	wg.Wait()
	if created != 1 || others != n-1 {
		t.Errorf("created %d, bound to other %d; want 1 and %d", created, others, n-1)
	}
}

func TestUnbind(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	provision(t, db, "sim-1", "d1")
	if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: "u1"}); err != nil {
		t.Fatal(err)
	}
	unbind := func(dev, user string) error {
		_, err := db.Unbind(ctx, dev, user)
		return err
	}
	wantErr(t, "Unbind(other user)", unbind("d1", "u2"), companion.ErrNotFound)
	wantErr(t, "Unbind(unknown device)", unbind("d9", "u1"), companion.ErrNotFound)
	mustNil(t, "Unbind", unbind("d1", "u1"))
	wantErr(t, "Unbind again", unbind("d1", "u1"), companion.ErrNotFound)
	_, err := db.Binding(ctx, "d1")
	wantErr(t, "Binding after Unbind", err, companion.ErrNotFound)
	if bs, err := db.ListBindings(ctx, "u1", "", 0); err != nil || len(bs) != 0 {
		t.Errorf("ListBindings after Unbind = %+v, %v; want none", bs, err)
	}
	// The device can be bound again, by anyone.
	if _, created, err := db.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: "u2"}); err != nil || !created {
		t.Errorf("Bind after Unbind = %v, %v; want created", created, err)
	}
}

func TestListBindingsPagination(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	var mine []string
	for i := range 23 {
		mine = append(mine, fmt.Sprintf("dev-%02d", i))
	}
	provision(t, db, "sim-1", mine...)
	provision(t, db, "sim-1", "dev-05x", "zzz", "a")
	// Bind concurrently: Batch groups them, which is what the API does.
	var wg sync.WaitGroup
	for _, id := range mine {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: id, UserID: "u1"}); err != nil {
				t.Error(err)
			}
		}()
	}
	for _, id := range []string{"dev-05x", "zzz", "a"} {
		if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: id, UserID: "u2"}); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()

	for _, limit := range []int{1, 5, 7, 23, 50} {
		t.Run(fmt.Sprint("limit ", limit), func(t *testing.T) {
			var got []string
			after := ""
			for pages := 0; ; pages++ {
				if pages > 30 {
					t.Fatal("pagination does not end")
				}
				page, err := db.ListBindings(ctx, "u1", after, limit)
				if err != nil {
					t.Fatal(err)
				}
				if len(page) > limit {
					t.Fatalf("ListBindings(limit %d) gave %d", limit, len(page))
				}
				for _, b := range page {
					if b.UserID != "u1" {
						t.Errorf("ListBindings(u1) gave %+v", b)
					}
					got = append(got, b.DeviceID)
				}
				if len(page) < limit {
					break
				}
				after = page[len(page)-1].DeviceID
			}
			if !slices.Equal(got, mine) {
				t.Errorf("pages = %v; want %v", got, mine)
			}
		})
	}

	tests := []struct {
		user, after string
		limit       int
		want        []string
	}{
		{"u2", "", 0, []string{"a", "dev-05x", "zzz"}},
		{"u2", "a", 0, []string{"dev-05x", "zzz"}},
		{"u2", "b", 1, []string{"dev-05x"}},
		{"u2", "zzz", 10, nil},
		{"u1", "dev-21", 10, []string{"dev-22"}},
		{"nobody", "", 10, nil},
	}
	for _, tt := range tests {
		page, err := db.ListBindings(ctx, tt.user, tt.after, tt.limit)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, b := range page {
			got = append(got, b.DeviceID)
		}
		if !slices.Equal(got, tt.want) {
			t.Errorf("ListBindings(%q, %q, %d) = %v; want %v", tt.user, tt.after, tt.limit, got, tt.want)
		}
	}
	_, err := db.ListBindings(ctx, "u1", "a\x00b", 10)
	wantErr(t, "ListBindings(bad cursor)", err, companion.ErrInvalidCursor)
}

func TestListDevices(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	provision(t, db, "sim-1", "a", "b", "c", "other")
	for _, id := range []string{"a", "b", "c"} {
		if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: id, UserID: "u1", Name: "name " + id}); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: "other", UserID: "u2"}); err != nil {
		t.Fatal(err)
	}
	battery := 70
	for _, id := range []string{"a", "c"} {
		if _, err := db.PutStatus(ctx, companion.Status{DeviceID: id, Online: true, Battery: &battery, Seq: 1}); err != nil {
			t.Fatal(err)
		}
	}

	tests := []struct {
		user, after string
		limit       int
		want        []string // device ids
		online      []bool
	}{
		{"u1", "", 0, []string{"a", "b", "c"}, []bool{true, false, true}},
		{"u1", "a", 1, []string{"b"}, []bool{false}},
		{"u1", "b", 10, []string{"c"}, []bool{true}},
		{"u2", "", 10, []string{"other"}, []bool{false}},
		{"nobody", "", 10, nil, nil},
	}
	for _, tt := range tests {
		ds, err := db.ListDevices(ctx, tt.user, tt.after, tt.limit)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		var online []bool
		for _, d := range ds {
			got = append(got, d.Binding.DeviceID)
			online = append(online, d.Status.Online)
			if d.Status.DeviceID != d.Binding.DeviceID || d.Binding.UserID != tt.user {
				t.Errorf("ListDevices(%q) gave %+v", tt.user, d)
			}
			// The same as the single reads.
			if s, err := db.Status(ctx, d.Binding.DeviceID); err != nil || !reflect.DeepEqual(s, d.Status) {
				t.Errorf("ListDevices status of %s = %+v; Status = %+v, %v", d.Binding.DeviceID, d.Status, s, err)
			}
		}
		if !slices.Equal(got, tt.want) || !slices.Equal(online, tt.online) {
			t.Errorf("ListDevices(%q, %q, %d) = %v online %v; want %v online %v", tt.user, tt.after, tt.limit, got, online, tt.want, tt.online)
		}
	}
	_, err := db.ListDevices(ctx, "u1", "a\x00b", 10)
	wantErr(t, "ListDevices(bad cursor)", err, companion.ErrInvalidCursor)
}
