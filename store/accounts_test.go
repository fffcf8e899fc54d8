package store

import (
	"bytes"
	"context"
	"crypto/sha256"
	"testing"

	"github.com/devicecompanion/companion"
)

func hashOf(s string) []byte {
	h := sha256.Sum256([]byte(s))
	return h[:]
}

func TestCreateUser(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	mustNil(t, "CreateUser(u1)", db.CreateUser(ctx, companion.User{ID: "u1", Name: "Ann", TokenHash: hashOf("t1")}))

	tests := []struct {
		name string
		u    companion.User
		want error
	}{
		{"second user", companion.User{ID: "u2", Name: "Bob", TokenHash: hashOf("t2")}, nil},
		{"same id", companion.User{ID: "u1", TokenHash: hashOf("t3")}, companion.ErrExists},
		{"same token", companion.User{ID: "u3", TokenHash: hashOf("t1")}, companion.ErrExists},
		{"no id", companion.User{TokenHash: hashOf("t4")}, companion.ErrInvalid},
		{"no token", companion.User{ID: "u4"}, companion.ErrInvalid},
		{"NUL in id", companion.User{ID: "u\x005", TokenHash: hashOf("t5")}, companion.ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantErr(t, "CreateUser", db.CreateUser(ctx, tt.u), tt.want)
		})
	}

	u, err := db.User(ctx, "u1")
	if err != nil || u.Name != "Ann" || !u.CreatedAt.Equal(clock.Now()) || !bytes.Equal(u.TokenHash, hashOf("t1")) {
		t.Errorf("User(u1) = %+v, %v", u, err)
	}
	_, err = db.User(ctx, "nobody")
	wantErr(t, "User(nobody)", err, companion.ErrNotFound)
	_, err = db.User(ctx, "")
	wantErr(t, "User(\"\")", err, companion.ErrNotFound)
	// A failed CreateUser left no index entry behind.
	_, err = db.UserByTokenHash(ctx, hashOf("t3"))
	wantErr(t, "UserByTokenHash(t3)", err, companion.ErrNotFound)
}

func TestUserByTokenHash(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	mustNil(t, "CreateUser", db.CreateUser(ctx, companion.User{ID: "u1", Name: "Ann", TokenHash: hashOf("t1")}))
	tests := []struct {
		name   string
		hash   []byte
		wantID string
		want   error
	}{
		{"right token", hashOf("t1"), "u1", nil},
		{"wrong token", hashOf("t2"), "", companion.ErrNotFound},
		{"empty", nil, "", companion.ErrNotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			u, err := db.UserByTokenHash(ctx, tt.hash)
			wantErr(t, "UserByTokenHash", err, tt.want)
			if u.ID != tt.wantID {
				t.Errorf("UserByTokenHash(%x).ID = %q; want %q", tt.hash, u.ID, tt.wantID)
			}
		})
	}

	// The returned hash is a copy: changing it changes nothing stored.
	u, _ := db.UserByTokenHash(ctx, hashOf("t1"))
	u.TokenHash[0] ^= 0xff
	if _, err := db.UserByTokenHash(ctx, hashOf("t1")); err != nil {
		t.Errorf("UserByTokenHash after changing a returned hash = %v", err)
	}
}

func TestProvisionDevice(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	d := companion.RegistryDevice{ID: "dev-1", Model: "sim-1", ClaimHash: hashOf("claim")}
	mustNil(t, "ProvisionDevice", db.ProvisionDevice(ctx, d))
	wantErr(t, "ProvisionDevice again", db.ProvisionDevice(ctx, d), companion.ErrExists)
	wantErr(t, "ProvisionDevice(no id)", db.ProvisionDevice(ctx, companion.RegistryDevice{Model: "x"}), companion.ErrInvalid)

	got, err := db.RegistryDevice(ctx, "dev-1")
	if err != nil || got.Model != "sim-1" || !bytes.Equal(got.ClaimHash, hashOf("claim")) || got.CreatedAt.IsZero() {
		t.Errorf("RegistryDevice(dev-1) = %+v, %v", got, err)
	}
	_, err = db.RegistryDevice(ctx, "dev-2")
	wantErr(t, "RegistryDevice(dev-2)", err, companion.ErrNotFound)
}

func TestBridges(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	mustNil(t, "CreateBridge", db.CreateBridge(ctx, companion.Bridge{ID: "br1", SecretHash: hashOf("s1")}))
	tests := []struct {
		name string
		b    companion.Bridge
		want error
	}{
		{"same id", companion.Bridge{ID: "br1", SecretHash: hashOf("s2")}, companion.ErrExists},
		{"same secret", companion.Bridge{ID: "br2", SecretHash: hashOf("s1")}, companion.ErrExists},
		{"no secret", companion.Bridge{ID: "br3"}, companion.ErrInvalid},
		{"another", companion.Bridge{ID: "br4", SecretHash: hashOf("s4")}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantErr(t, "CreateBridge", db.CreateBridge(ctx, tt.b), tt.want)
		})
	}

	if b, err := db.Bridge(ctx, "br1"); err != nil || !bytes.Equal(b.SecretHash, hashOf("s1")) {
		t.Errorf("Bridge(br1) = %+v, %v", b, err)
	}
	_, err := db.Bridge(ctx, "nope")
	wantErr(t, "Bridge(nope)", err, companion.ErrNotFound)
	if b, err := db.BridgeBySecretHash(ctx, hashOf("s4")); err != nil || b.ID != "br4" {
		t.Errorf("BridgeBySecretHash(s4) = %+v, %v", b, err)
	}
	_, err = db.BridgeBySecretHash(ctx, hashOf("s2"))
	wantErr(t, "BridgeBySecretHash(s2)", err, companion.ErrNotFound)
}
