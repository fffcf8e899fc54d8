package broker

import (
	"context"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/broker/embedded"
)

// AccountStore is what Accounts needs of the store.
type AccountStore interface {
	Bridge(ctx context.Context, id string) (companion.Bridge, error)
	User(ctx context.Context, id string) (companion.User, error)
	Binding(ctx context.Context, deviceID string) (companion.Binding, error)
	BridgeServes(ctx context.Context, bridgeID, deviceID string) (bool, error)
}

// Accounts tells the embedded MQTT broker who may connect and what users
// own, from the store: bridges log in with their id and secret, users with
// their user id and API token. Both secrets are kept only as SHA-256 hashes
// and compared in constant time.
type Accounts struct {
	Store AccountStore
}

var _ embedded.Accounts = Accounts{}

// Authenticate implements embedded.Accounts.
func (a Accounts) Authenticate(ctx context.Context, username, password string) (embedded.Identity, bool) {
	if username == "" || password == "" {
		return embedded.Identity{}, false
	}
	if b, err := a.Store.Bridge(ctx, username); err == nil {
		if companion.SecretMatches(password, b.SecretHash) {
			return embedded.Identity{Role: embedded.RoleBridge, ID: b.ID}, true
		}
		return embedded.Identity{}, false
	}
	if u, err := a.Store.User(ctx, username); err == nil {
		if companion.SecretMatches(password, u.TokenHash) {
			return embedded.Identity{Role: embedded.RoleUser, ID: u.ID}, true
		}
	}
	return embedded.Identity{}, false
}

// UserOwnsDevice implements embedded.Accounts.
func (a Accounts) UserOwnsDevice(ctx context.Context, userID, deviceID string) bool {
	b, err := a.Store.Binding(ctx, deviceID)
	return err == nil && b.UserID == userID
}

// BridgeServesDevice implements embedded.Accounts.
func (a Accounts) BridgeServesDevice(ctx context.Context, bridgeID, deviceID string) bool {
	ok, err := a.Store.BridgeServes(ctx, bridgeID, deviceID)
	return err == nil && ok
}
