package natsauth

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"sort"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
)

// The system account's requests the responder uses (nats-server's
// server/events.go): every node answers a CONNZ ping with its own
// connections; KICK closes one connection of one node.
const (
	connzPing   = "$SYS.REQ.SERVER.PING.CONNZ"
	kickSubject = "$SYS.REQ.SERVER.%s.KICK"
)

// Gathering the nodes' answers to a CONNZ ping: done once as many nodes
// answered as the connection knows of, or when none answered for
// connzQuiet, and at most connzMax.
const (
	connzQuiet = 250 * time.Millisecond
	connzMax   = 2 * time.Second
	// connzLimit is how many connections of one account a node lists.
	connzLimit = 4096
)

// ErrNoSystemUser is returned when connections should be closed and the
// responder has no system user to do it with.
var ErrNoSystemUser = errors.New("natsauth: no system user: connections whose rights changed keep them until they log in again")

// UserCreated does nothing: the store is asked at each login.
func (r *Responder) UserCreated(context.Context, string, string) error { return nil }

// BridgeCreated does nothing: the store is asked at each login.
func (r *Responder) BridgeCreated(context.Context, string, string) error { return nil }

// BridgeDeleted closes the bridge's connections: its secret no longer
// opens anything.
func (r *Responder) BridgeDeleted(ctx context.Context, bridgeID string) error {
	return r.Disconnect(ctx, bridgeID)
}

// UserTokenChanged closes the user's connections: the store, asked at
// each login, refuses the old token from now on.
func (r *Responder) UserTokenChanged(ctx context.Context, userID, _ string) error {
	return r.Disconnect(ctx, userID)
}

// BridgeSecretChanged closes the bridge's connections: the store, asked at
// each login, refuses the old secret from now on.
func (r *Responder) BridgeSecretChanged(ctx context.Context, bridgeID, _ string) error {
	return r.Disconnect(ctx, bridgeID)
}

// Bound does nothing: a device bound adds rights, and the user's
// connections keep those of their login, the device's coming with the
// next (the store is asked at each). Closed for it, every watcher of the
// user's other devices was cut, and lost what came meanwhile, at each
// register of theirs (docs/reliability.md, bug 349). Unbound closes them:
// a device unbound must take its topics at once.
func (r *Responder) Bound(context.Context, string, string) error { return nil }

// Unbound closes the user's connections, so that they log in again
// without the device's topics.
func (r *Responder) Unbound(ctx context.Context, userID, _ string) error {
	return r.Disconnect(ctx, userID)
}

// DisconnectPublishesWill says that NATS publishes the Will of an MQTT
// connection it closes (Disconnect), as of one lost: the server holds a
// bridge's for a while after its rights changed (api.WillOnDisconnect).
func (r *Responder) DisconnectPublishesWill() bool { return true }

// Assigned closes the connections of the bridge the device left and of
// the bridge it joined: they log in again with the rights the store gives
// them now (CONTRACT §9: moving a device moves the rights at once).
func (r *Responder) Assigned(ctx context.Context, _, from, to string) error {
	var names []string
	for _, b := range []string{from, to} {
		if b != "" {
			names = append(names, b)
		}
	}
	return r.Disconnect(ctx, names...)
}

// Disconnect closes, on every node, the MQTT connections in the
// responder's account logged in with the usernames (a bridge id, a user
// id), and returns once the nodes have closed them. What fails is tried
// again every RetryInterval while the responder runs, and returned too.
func (r *Responder) Disconnect(ctx context.Context, usernames ...string) error {
	if len(usernames) == 0 {
		return nil
	}
	if r.sys == nil {
		return ErrNoSystemUser
	}
	var errs []error
	for _, u := range usernames {
		// The other replicas' responders close the logins they are
		// answering, or lately let in, for the username (onChanged):
		// their rights may have been read before the change, and no node
		// lists such a connection yet (bug 233).
		r.tellChanged(u)
		n, err := r.kick(ctx, u)
		if err != nil {
			r.log.Error("connections whose rights changed not closed; retrying", "username", u, "err", err, "in", r.opts.RetryInterval)
			signal(r.retry)
			errs = append(errs, err)
			continue
		}
		if n > 0 {
			r.log.Info("connections closed: rights changed", "username", u, "connections", n)
		}
	}
	return errors.Join(errs...)
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// kick closes the username's connections, as disconnect, and keeps the
// username pending (for retryLoop) until that succeeds.
func (r *Responder) kick(ctx context.Context, username string) (int, error) {
	n, err := r.disconnect(ctx, username)
	r.mu.Lock()
	if err != nil {
		r.pending[username] = true
	} else {
		delete(r.pending, username)
	}
	r.mu.Unlock()
	return n, err
}

// connRef is one connection of one node.
type connRef struct {
	serverID, serverName string
	cid                  uint64
	user                 string // the username it logged in with
}

// disconnect closes the username's connections and returns how many.
// Besides those the nodes list, it closes the logins under way or lately
// let in (loginsOf): their rights may have been read before the change,
// and a node lists a connection only once it has taken the answer in.
func (r *Responder) disconnect(ctx context.Context, username string) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, r.opts.Timeout)
	defer cancel()
	under := r.loginsOf(username)
	conns, err := r.connz(ctx, connzFilter{User: username})
	if err != nil {
		return 0, err
	}
	listed := map[connRef]bool{}
	for _, c := range conns {
		listed[connRef{serverID: c.serverID, cid: c.cid}] = true
	}
	for _, c := range under {
		if !listed[connRef{serverID: c.serverID, cid: c.cid}] {
			conns = append(conns, c)
		}
	}
	return r.close(ctx, conns)
}

// changedSubject carries, in the callout's account, the usernames whose
// rights a replica changed, to every replica's responder (not a queue
// group): each closes the logins of that username it is answering or
// lately let in (onChanged). Only the callout's auth_users see it.
const changedSubject = "companion.auth.changed"

// changedNotice is a message on changedSubject.
type changedNotice struct {
	From     string `json:"from"` // the responder that sent it: it closed its own logins
	Username string `json:"username"`
}

// tellChanged tells the other responders that username's rights changed.
// It is best effort: a notice lost (the connection down) leaves a login
// under way on another replica with its old rights, as before there were
// notices.
func (r *Responder) tellChanged(username string) {
	if r.sys == nil {
		return // none of the responders closes connections
	}
	b, _ := json.Marshal(changedNotice{From: r.id, Username: username})
	if err := r.auth.Publish(changedSubject, b); err != nil {
		r.log.Warn("the other replicas not told of a change of rights; their logins under way keep the old rights", "username", username, "err", err)
	}
}

// onChanged takes another responder's notice (tellChanged): the logins
// of the username this responder is answering, or let in within
// loginSettle, are closed. A close that fails is retried as Disconnect's
// are.
func (r *Responder) onChanged(m *nats.Msg) {
	var n changedNotice
	if err := json.Unmarshal(m.Data, &n); err != nil || n.From == r.id || n.Username == "" || r.sys == nil {
		return
	}
	under := r.loginsOf(n.Username)
	if len(under) == 0 {
		return
	}
	r.goroutine(func() {
		ctx, cancel := context.WithTimeout(r.ctx, r.opts.Timeout) // Close cancels it
		defer cancel()
		closed, err := r.close(ctx, under)
		if err != nil {
			r.log.Error("logins under way whose rights changed on another replica not closed; retrying", "username", n.Username, "err", err, "in", r.opts.RetryInterval)
			r.mu.Lock()
			r.pending[n.Username] = true
			r.mu.Unlock()
			signal(r.retry)
			return
		}
		if closed > 0 {
			r.log.Info("logins under way closed: rights changed on another replica", "username", n.Username, "connections", closed)
		}
	})
}

// close closes the connections and returns how many it closed; one the
// node no longer has counts as closed already.
func (r *Responder) close(ctx context.Context, conns []connRef) (int, error) {
	n := 0
	for _, c := range conns {
		body, _ := json.Marshal(map[string]uint64{"cid": c.cid})
		m, err := r.sys.RequestWithContext(ctx, fmt.Sprintf(kickSubject, c.serverID), body)
		if err != nil {
			return n, fmt.Errorf("kick connection %d on %s: %w", c.cid, c.serverName, err)
		}
		var resp apiResponse
		if err := json.Unmarshal(m.Data, &resp); err != nil {
			return n, fmt.Errorf("kick connection %d on %s: %w", c.cid, c.serverName, err)
		}
		switch {
		case resp.Error == nil:
			n++
		case !strings.Contains(resp.Error.Description, "no such client"):
			return n, fmt.Errorf("kick connection %d on %s: %s", c.cid, c.serverName, resp.Error.Description)
		}
	}
	return n, nil
}

// loginSettle is how long after a login is let in the responder still
// counts it as under way: a node takes the answer in, and lists the
// connection, as soon as the answer arrives, and takes no answer later
// than its authorization timeout (5 s in docs/scale-out.md).
const loginSettle = 10 * time.Second

// login is one connection's authorization, from before its rights are
// read until loginSettle after it was let in.
type login struct {
	username string
	clientID string    // its MQTT client id
	conn     connRef   // the node and the connection asking
	seq      uint64    // the order logins began in, on this responder
	until    time.Time // zero while it is being answered
}

// beginLogin notes the login req asks for, before its rights are read: a
// change of rights from then on closes it (disconnect).
func (r *Responder) beginLogin(req *jwt.AuthorizationRequestClaims) *login {
	l := &login{
		username: req.ConnectOptions.Username,
		clientID: req.ClientInformation.MQTT,
		conn:     connRef{serverID: req.Server.ID, serverName: req.Server.Name, cid: req.ClientInformation.ID},
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.settle()
	r.begun++
	l.seq = r.begun
	if r.logins[l.username] == nil {
		r.logins[l.username] = map[*login]bool{}
	}
	r.logins[l.username][l] = true
	if r.byClient[l.clientID] == nil {
		r.byClient[l.clientID] = map[*login]bool{}
	}
	r.byClient[l.clientID][l] = true
	return l
}

// endLogin forgets a login that was refused or not answered, and keeps
// one let in for loginSettle.
func (r *Responder) endLogin(l *login, let bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !let {
		r.forget(l)
		return
	}
	l.until = time.Now().Add(loginSettle)
	r.settling = append(r.settling, l)
}

// loginsOf returns the connections of the username's logins under way or
// let in within loginSettle.
func (r *Responder) loginsOf(username string) []connRef {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.settle()
	var out []connRef
	for l := range r.logins[username] {
		out = append(out, l.conn)
	}
	return out
}

// settle forgets the logins let in more than loginSettle ago. Run with
// r.mu held.
func (r *Responder) settle() {
	now := time.Now()
	for len(r.settling) > 0 && now.After(r.settling[0].until) {
		r.forget(r.settling[0])
		r.settling[0] = nil
		r.settling = r.settling[1:]
	}
}

// forget drops a login. Run with r.mu held.
func (r *Responder) forget(l *login) {
	delete(r.logins[l.username], l)
	if len(r.logins[l.username]) == 0 {
		delete(r.logins, l.username)
	}
	delete(r.byClient[l.clientID], l)
	if len(r.byClient[l.clientID]) == 0 {
		delete(r.byClient, l.clientID)
	}
}

// earlierLoginWith returns the username of another account whose login
// with clientID began before l and is being answered, or was let in
// within loginSettle; "" when there is none.
func (r *Responder) earlierLoginWith(clientID string, l *login) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.settle()
	for o := range r.byClient[clientID] {
		if o.seq < l.seq && o.username != l.username {
			return o.username
		}
	}
	return ""
}

// apiResponse is the part of nats-server's ServerAPIResponse read here.
type apiResponse struct {
	Server struct {
		Name string `json:"name"`
		ID   string `json:"id"`
	} `json:"server"`
	Data  json.RawMessage `json:"data"`
	Error *struct {
		Code        int    `json:"code"`
		Description string `json:"description"`
	} `json:"error"`
}

// connzFilter is what a CONNZ ping selects, besides the responder's
// account (nats-server's ConnzOptions, server/monitor.go).
type connzFilter struct {
	User       string `json:"user,omitempty"`
	MQTTClient string `json:"mqtt_client,omitempty"`
}

// connz asks every node for the open connections in the responder's
// account that match f.
func (r *Responder) connz(ctx context.Context, f connzFilter) ([]connRef, error) {
	if !r.sys.IsConnected() {
		return nil, errors.New("not connected to the system account")
	}
	inbox := r.sys.NewRespInbox()
	ch := make(chan *nats.Msg, 64)
	sub, err := r.sys.ChanSubscribe(inbox, ch)
	if err != nil {
		return nil, err
	}
	defer func() { _ = sub.Unsubscribe() }()
	// "auth" adds each connection's username. The callout's clients carry
	// no JWT of their own in it: NATS clears it (server/auth_callout.go).
	body, _ := json.Marshal(struct {
		connzFilter
		Account string `json:"acc"`
		Auth    bool   `json:"auth"`
		Limit   int    `json:"limit"`
	}{f, r.opts.Account, true, connzLimit})
	if err := r.sys.PublishRequest(connzPing, inbox, body); err != nil {
		return nil, err
	}
	nodes := r.knownNodes()
	seen := map[string]bool{}
	var out []connRef
	quiet := time.NewTimer(connzMax)
	defer quiet.Stop()
	max := time.NewTimer(connzMax)
	defer max.Stop()
	for len(seen) < nodes || nodes == 0 {
		select {
		case m := <-ch:
			var resp apiResponse
			if err := json.Unmarshal(m.Data, &resp); err != nil {
				return nil, fmt.Errorf("CONNZ answer: %w", err)
			}
			if resp.Error != nil {
				return nil, fmt.Errorf("CONNZ on %s: %s", resp.Server.Name, resp.Error.Description)
			}
			var cz struct {
				Conns []struct {
					CID  uint64 `json:"cid"`
					User string `json:"authorized_user"`
				} `json:"connections"`
			}
			if err := json.Unmarshal(resp.Data, &cz); err != nil {
				return nil, fmt.Errorf("CONNZ on %s: %w", resp.Server.Name, err)
			}
			seen[resp.Server.ID] = true
			for _, c := range cz.Conns {
				out = append(out, connRef{serverID: resp.Server.ID, serverName: resp.Server.Name, cid: c.CID, user: c.User})
			}
			quiet.Reset(connzQuiet)
		case <-quiet.C:
			return r.gathered(seen, out)
		case <-max.C:
			return r.gathered(seen, out)
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return out, nil
}

func (r *Responder) gathered(seen map[string]bool, out []connRef) ([]connRef, error) {
	if len(seen) == 0 {
		return nil, errors.New("no NATS node answered the CONNZ request (is the system user in the system account?)")
	}
	return out, nil
}

// knownNodes is how many nodes the system connection knows of: the URLs
// it was given and those the cluster told it of, by host and port. A URL
// that is not a node (a load balancer) makes it too many, and the CONNZ
// gathering then ends on silence instead.
func (r *Responder) knownNodes() int {
	hosts := map[string]bool{}
	for _, s := range r.sys.Servers() {
		if u, err := url.Parse(s); err == nil && u.Host != "" {
			hosts[u.Host] = true
		}
	}
	return len(hosts)
}

// retryLoop closes, every RetryInterval, the connections Disconnect
// failed to close.
func (r *Responder) retryLoop() {
	ctx := r.ctx // done when Close is called: the kick under way ends
	t := time.NewTimer(time.Hour)
	t.Stop()
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.retry:
			t.Reset(r.opts.RetryInterval)
			continue
		case <-t.C:
		}
		r.mu.Lock()
		names := make([]string, 0, len(r.pending))
		for u := range r.pending {
			names = append(names, u)
		}
		r.mu.Unlock()
		sort.Strings(names)
		failed := false
		for _, u := range names {
			n, err := r.kick(ctx, u)
			if err != nil {
				failed = true
				continue
			}
			r.log.Info("connections closed on retry: rights changed", "username", u, "connections", n)
		}
		if failed {
			t.Reset(r.opts.RetryInterval)
		}
	}
}
