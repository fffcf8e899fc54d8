package natsauth

import (
	"context"

	"github.com/nats-io/jwt/v2"

	"github.com/devicecompanion/companion/broker/embedded"
)

// clientIDHolder returns the username of another account that has a
// connection open, on any node, with the MQTT client id of the login req
// asks about (l), or whose login with it began before l on this responder
// and is under way or lately let in; "" when none has.
//
// NATS lets a login take a client id over from any account in the
// cluster: it closes the other connection. The embedded broker refuses a
// login whose client id is another account's, and so does the responder,
// as far as NATS shows it: the open connections (CONNZ filtered by MQTT
// client id, with their usernames). A persistent session whose client is
// offline is not among them, and NATS keeps no username with it. Without
// a system user nothing is asked; nor for a reserved client id, which
// embedded.MayUseClientID has decided.
//
// A connection is listed only once its node has the answer: two logins
// of two accounts with one client id at the same moment both found none,
// both were let in, and the later took the earlier's session over. So the
// logins this responder answers count too, the first begun winning; those
// that other responders (of other replicas) answer do not.
func (r *Responder) clientIDHolder(ctx context.Context, req *jwt.AuthorizationRequestClaims, l *login) (string, error) {
	ci := req.ClientInformation
	if ci.MQTT == "" || embedded.ReservedClientID(ci.MQTT) {
		return "", nil
	}
	if holder := r.earlierLoginWith(ci.MQTT, l); holder != "" {
		return holder, nil
	}
	if r.sys == nil {
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
