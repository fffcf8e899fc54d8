package natsauth

import (
	"context"

	"github.com/nats-io/jwt/v2"

	"github.com/devicecompanion/companion/broker/embedded"
)

// clientIDHolder returns the username of another account that has a
// connection open, on any node, with the MQTT client id of the login req
// asks about; "" when none has.
//
// NATS lets a login take a client id over from any account in the
// cluster: it closes the other connection. The embedded broker refuses a
// login whose client id is another account's, and so does the responder,
// as far as NATS shows it: the open connections (CONNZ filtered by MQTT
// client id, with their usernames). A persistent session whose client is
// offline is not among them, and NATS keeps no username with it. Without
// a system user nothing is asked; nor for a reserved client id, which
// embedded.MayUseClientID has decided.
func (r *Responder) clientIDHolder(ctx context.Context, req *jwt.AuthorizationRequestClaims) (string, error) {
	ci := req.ClientInformation
	if r.sys == nil || ci.MQTT == "" || embedded.ReservedClientID(ci.MQTT) {
		return "", nil
	}
	conns, err := r.connz(ctx, connzFilter{MQTTClient: ci.MQTT})
	if err != nil {
		return "", err
	}
	for _, c := range conns {
		if c.serverID == req.Server.ID && c.cid == ci.ID {
			continue // the login being decided
		}
		if c.user != req.ConnectOptions.Username {
			return c.user, nil
		}
	}
	return "", nil
}
