package dynsec

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/topics"
)

// Conn is what the driver needs of an MQTT connection. *broker.Broker
// implements it with the server's own connection.
type Conn interface {
	// Subscribe subscribes on every connect; see broker.Broker.Subscribe.
	Subscribe(filter string, msg func(payload []byte), subscribed func(granted bool)) error
	// Publish publishes at QoS 1 and waits for the PUBACK or ctx.
	Publish(ctx context.Context, topic string, payload []byte) error
}

// Store is what the driver needs of the store: who owns which device, and
// which bridge serves which.
type Store interface {
	Binding(ctx context.Context, deviceID string) (companion.Binding, error)
	ListBindings(ctx context.Context, userID, after string, limit int) ([]companion.Binding, error)
	Bridge(ctx context.Context, id string) (companion.Bridge, error)
	User(ctx context.Context, id string) (companion.User, error)
	ServedDevices(ctx context.Context, bridgeID string) ([]string, error)
	BridgeServes(ctx context.Context, bridgeID, deviceID string) (bool, error)
}

// AccountLocker is what a Store shared by replicas has as well (the
// PostgreSQL store): LockAccount holds the lock of the account id, which
// the store's creation of a bridge or user of that id waits for, until
// unlock. With it the driver's read of a bridge and its write of the
// bridge's account are one step for every replica; without it, for this
// process only (its own lock), which is enough where the store is not
// shared (bbolt). See Driver.lockAccount.
type AccountLocker interface {
	LockAccount(ctx context.Context, id string) (unlock func(), err error)
}

// Options configure New. The zero value of each optional field means its
// default.
type Options struct {
	Conn  Conn  // required
	Store Store // required; an AccountLocker too where replicas share it
	// ServerUsername is the server's own Mosquitto account: a bridge of
	// that name is refused rather than given the server's account.
	ServerUsername string
	// PinClientIDs ties each bridge's account to the client id
	// BridgeClientID(bridge id) and each user's to UserClientID(user id):
	// then no account the server makes can take the server's session, a
	// bridge's or a user's, but each has one MQTT connection at a time,
	// with that client id. Off, they log in with any client id (CONTRACT
	// §3's watcher), the server's and the bridges' included.
	PinClientIDs  bool
	Topics        topics.Tree   // default topics.DefaultPrefix
	Timeout       time.Duration // how long one request waits for its answer; default 10s
	RetryInterval time.Duration // how soon a failed change is tried again; default 30s
	// CheckInterval is how often the plugin's default ACL access and the
	// clients the server made are checked between connects (check);
	// default 5m.
	CheckInterval time.Duration
	Logger        *slog.Logger
	// DisconnectedWithoutWill, when set, is told of each bridge whose
	// account a retry wrote (Reconcile), and of each whose client
	// Reconcile deleted as it had a secret the store no longer has:
	// setting the password of a client, or deleting it, closes its
	// connections without their Will, and the bridge, given a new secret
	// while Mosquitto was away, does not come back with the old one. The
	// server publishes the Will of a bridge not back within the grace
	// (broker.Broker.BridgesDisconnectingWithoutWill), as for the API's
	// own changes (docs/reliability.md, bugs 301 and 303).
	DisconnectedWithoutWill func(bridgeIDs ...string)
}

// Driver keeps Mosquitto's accounts and ACLs true. Create it with New
// (before the broker starts), start it with Start, stop it with Close.
type Driver struct {
	opts Options
	conn Conn
	st   Store
	tree topics.Tree
	log  *slog.Logger

	idPrefix string // of correlation data: unique to this process
	seq      atomic.Uint64

	mu         sync.Mutex
	waiting    map[string]chan []Response // correlation id → waiter
	granted    bool                       // the response topic is subscribed
	refused    bool                       // … and was refused: not the plugin's admin
	unanswered bool                       // the last request was not answered: only Reconcile asks (do)
	retry      []account                  // creations that failed, with their passwords (memory only)
	connected  chan struct{}              // one signal per (re)subscription
	kick       chan struct{}              // a change failed: schedule a retry
	wide       map[string]widened         // clients named by besides, by username

	change sync.Mutex // serialises changes to the plugin

	quit chan struct{}
	wg   sync.WaitGroup
}

// account is a client to create with its role.
type account struct {
	kind     string // "bridge" or "user", for logs
	username string
	password string
	clientID string // the only MQTT client id it may connect with
	role     string
	acls     []ACL
	// mark is the client's text description: a bridge's is the secret's
	// (secretMark), a user's the token's (none on a client made before
	// bug 298).
	mark string
	// held says that the store had the account with this password, read
	// under the account's lock (lockHeld) as the change was made: its
	// retry replaces those of the account queued before (retryLater).
	held bool
}

// ErrUnavailable is the answer while the server cannot use the plugin: not
// connected yet, its account may not subscribe to the response topic, or
// the plugin left the last request unanswered (until Reconcile has an
// answer; see do).
var ErrUnavailable = errors.New("dynsec: the dynamic-security plugin cannot be reached")

// New checks the options and subscribes to the plugin's responses on conn;
// call it before the connection starts.
func New(opts Options) (*Driver, error) {
	if opts.Conn == nil || opts.Store == nil {
		return nil, errors.New("dynsec: Conn and Store are required")
	}
	if opts.Topics == (topics.Tree{}) {
		opts.Topics = topics.MustNew(topics.DefaultPrefix)
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 10 * time.Second
	}
	if opts.RetryInterval <= 0 {
		opts.RetryInterval = 30 * time.Second
	}
	if opts.CheckInterval <= 0 {
		opts.CheckInterval = 5 * time.Minute
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		return nil, err
	}
	d := &Driver{
		opts:      opts,
		conn:      opts.Conn,
		st:        opts.Store,
		tree:      opts.Topics,
		log:       opts.Logger.With("component", "dynsec"),
		idPrefix:  "companion-" + hex.EncodeToString(b) + "-",
		waiting:   make(map[string]chan []Response),
		connected: make(chan struct{}, 1),
		kick:      make(chan struct{}, 1),
		wide:      map[string]widened{},
		quit:      make(chan struct{}),
	}
	if err := d.conn.Subscribe(ResponseTopic, d.response, d.subscribed); err != nil {
		return nil, err
	}
	return d, nil
}

// Start starts the loop that reconciles on every connect and retries what
// failed.
func (d *Driver) Start() {
	d.wg.Add(1)
	go d.run()
}

// Close stops the loop and waits for it.
func (d *Driver) Close() error {
	select {
	case <-d.quit:
	default:
		close(d.quit)
	}
	d.wg.Wait()
	return nil
}

func (d *Driver) subscribed(granted bool) {
	d.mu.Lock()
	d.granted = granted
	wasRefused := d.refused
	d.refused = !granted
	d.mu.Unlock()
	if !granted {
		if !wasRefused {
			d.log.Error("the server's MQTT account may not use the dynamic-security plugin: Mosquitto's accounts are not kept; " +
				"give it the plugin's admin role (docs/mosquitto.md) or run with --mqtt-dynsec=false")
		}
		return
	}
	signal(d.connected)
}

// NotReady says why the server cannot keep Mosquitto's accounts, for
// /readyz: nil but while Mosquitto refuses the server's subscription to
// the plugin's responses (its account is not the plugin's admin). The
// server's commands flow then, but every bridge and user it creates is
// refused at login, and no device assigned or moved is granted to its
// bridge; /readyz said ready all the same, and a bridge told only that
// its secret was wrong (docs/reliability.md, bug 483).
func (d *Driver) NotReady() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.refused {
		return nil
	}
	return fmt.Errorf("the MQTT broker refuses the server's account (%q) the dynamic-security plugin's responses (%s): it is not the plugin's admin, so no bridge or user account is made nor any device granted to its bridge; "+
		"give it the plugin's admin role (mosquitto_ctrl dynsec addClientRole %s admin; docs/mosquitto.md, section 2), or run with --mqtt-dynsec=false",
		d.opts.ServerUsername, ResponseTopic, d.opts.ServerUsername)
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// response takes one message of the response topic. It never blocks.
func (d *Driver) response(payload []byte) {
	var m struct {
		Responses []Response `json:"responses"`
	}
	if err := json.Unmarshal(payload, &m); err != nil || len(m.Responses) == 0 {
		return
	}
	d.mu.Lock()
	ch := d.waiting[m.Responses[0].CorrelationData]
	d.mu.Unlock()
	if ch != nil {
		select {
		case ch <- m.Responses:
		default:
		}
	}
}

// Do sends the commands in one message and returns the plugin's response
// to each, in order. A command the plugin refused is not an error of Do:
// see each Response's Err. After a request the plugin left unanswered,
// Do fails at once with ErrUnavailable until Reconcile has an answer.
func (d *Driver) Do(ctx context.Context, cmds ...Command) ([]Response, error) {
	return d.do(ctx, false, cmds)
}

// do is Do; a probe asks the plugin even after a request went unanswered.
//
// Mosquitto refuses the server's subscription to the response topic
// (SUBACK 0x80) when the plugin does not let its account read it, and
// subscribed then keeps every request back. Without the plugin (the static
// password and ACL files of docs/mosquitto.md, section 3, and the server
// left with --mqtt-dynsec on) Mosquitto grants it all the same, for an
// acl_file refuses no SUBSCRIBE, and nobody answers: each change then
// waited the whole timeout, one after another behind d.change, and each
// admin request with it (docs/reliability.md, bug 268). So after one
// unanswered request, changes fail at once, logged and left to the
// reconciling that follows (which retries creations too), until the
// plugin answers Reconcile's probe.
func (d *Driver) do(ctx context.Context, probe bool, cmds []Command) ([]Response, error) {
	if len(cmds) == 0 {
		return nil, nil
	}
	d.mu.Lock()
	ok := d.granted && (probe || !d.unanswered)
	d.mu.Unlock()
	if !ok {
		return nil, ErrUnavailable
	}
	id := d.idPrefix + fmt.Sprint(d.seq.Add(1))
	list := make([]Command, len(cmds))
	for i, c := range cmds {
		cc := make(Command, len(c)+1)
		for k, v := range c {
			cc[k] = v
		}
		cc["correlationData"] = id
		list[i] = cc
	}
	payload, err := json.Marshal(map[string]any{"commands": list})
	if err != nil {
		return nil, err
	}
	ch := make(chan []Response, 1)
	d.mu.Lock()
	d.waiting[id] = ch
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		delete(d.waiting, id)
		d.mu.Unlock()
	}()

	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, d.opts.Timeout)
	defer cancel()
	if err := d.conn.Publish(ctx, ControlTopic, payload); err != nil {
		return nil, fmt.Errorf("dynsec: publish: %w", err)
	}
	select {
	case rs := <-ch:
		d.setUnanswered(false)
		if len(rs) != len(cmds) {
			return nil, fmt.Errorf("dynsec: %d responses to %d commands", len(rs), len(cmds))
		}
		return rs, nil
	case <-ctx.Done():
		if parent.Err() == nil { // our timeout, not the caller's end
			d.setUnanswered(true)
		}
		return nil, fmt.Errorf("dynsec: no answer from the plugin: %w", ctx.Err())
	}
}

// setUnanswered notes whether the plugin left the last request unanswered,
// and logs the change.
func (d *Driver) setUnanswered(unanswered bool) {
	d.mu.Lock()
	was := d.unanswered
	d.unanswered = unanswered
	d.mu.Unlock()
	switch {
	case unanswered && !was:
		d.log.Error("the dynamic-security plugin did not answer; account changes fail until it does, and are reconciled then; "+
			"Mosquitto may run without it (a password and an ACL file: run the server with --mqtt-dynsec=false, docs/mosquitto.md)",
			"timeout", d.opts.Timeout)
	case !unanswered && was:
		d.log.Info("the dynamic-security plugin answers again")
	}
}

// isUnanswered says whether the plugin left the last request unanswered.
func (d *Driver) isUnanswered() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.unanswered
}

// noRole says whether err is the plugin's answer that the role does not
// exist.
func noRole(err error) bool {
	return notFound(err) && strings.Contains(err.Error(), "Role not found")
}

// BridgeRole and UserRole name the roles the server keeps.
func BridgeRole(bridgeID string) string { return "bridge-" + bridgeID }

// UserRole is the role of a user's client; see BridgeRole.
func UserRole(userID string) string { return "user-" + userID }

// BridgeClientID is the only MQTT client id a bridge's account may connect
// with when Options.PinClientIDs is set: the one the bridge uses (agent).
//
// Mosquitto lets any account take any client id: it closes the connection
// that had it and hands the newcomer its persistent session, so a user
// logging in as "companion-server" would cut the server off and take the
// replies queued for it (dropped, as the user may not read them). The
// plugin's only tie between accounts and client ids is a client id pinned
// to an account, which binds that account and no other. So with
// Options.PinClientIDs every account the server makes is pinned, and none
// can take the server's client id, a bridge's or a user's. Without it any
// can (the contract's watcher logs in with any client id);
// docs/mosquitto.md.
func BridgeClientID(bridgeID string) string { return "companion-bridge-" + bridgeID }

// UserClientID is the only MQTT client id a user's account may connect
// with when Options.PinClientIDs is set; see BridgeClientID. A user then
// has one MQTT connection at a time.
func UserClientID(userID string) string { return "companion-user-" + userID }

// BridgeACLs is what a bridge may do (CONTRACT §3, §9): subscribe to and
// receive the commands of the devices it serves, publish their replies,
// status and settings, and its own state (also its Will). The store says
// which devices it serves.
func (d *Driver) BridgeACLs(ctx context.Context, bridgeID string) ([]ACL, error) {
	served, err := d.st.ServedDevices(ctx, bridgeID)
	if err != nil {
		return nil, err
	}
	return d.bridgeACLs(bridgeID, served)
}

// bridgeACLs is BridgeACLs of a bridge that serves the devices served.
func (d *Driver) bridgeACLs(bridgeID string, served []string) ([]ACL, error) {
	state, err := d.tree.BridgeState(bridgeID)
	if err != nil {
		return nil, err
	}
	acls := []ACL{{Type: PublishClientSend, Topic: state, Allow: true}}
	for _, dev := range served {
		more, err := d.servedDeviceACLs(dev)
		if err != nil {
			return nil, err
		}
		acls = append(acls, more...)
	}
	return acls, nil
}

// servedDeviceACLs is what the bridge serving a device may do with it.
func (d *Driver) servedDeviceACLs(deviceID string) ([]ACL, error) {
	cmds, err := d.tree.CommandsGrant(deviceID)
	if err != nil {
		return nil, err
	}
	var acls []ACL
	acls = append(acls, ACL{Type: SubscribePattern, Topic: cmds, Allow: true}, ACL{Type: PublishClientReceive, Topic: cmds, Allow: true})
	for _, topic := range []func(string) (string, error){d.tree.Replies, d.tree.Status, d.tree.Settings} {
		t, err := topic(deviceID)
		if err != nil {
			return nil, err
		}
		acls = append(acls, ACL{Type: PublishClientSend, Topic: t, Allow: true})
	}
	return acls, nil
}

// deviceACLs is what the owner of a device may do with it: read its topics.
func (d *Driver) deviceACLs(deviceID string) ([]ACL, error) {
	f, err := d.tree.DeviceFilter(deviceID)
	if err != nil {
		return nil, err
	}
	return []ACL{
		{Type: SubscribePattern, Topic: f, Allow: true},
		{Type: PublishClientReceive, Topic: f, Allow: true},
	}, nil
}

// BridgeCreated gives a new bridge its Mosquitto account. On failure the
// account is retried while the process runs; the error is returned too.
//
// What the bridge serves is read with d.change held, as Assigned reads it:
// a device assigned to the bridge meanwhile is then either in the role as
// made, or granted by its Assigned, which waits for the role. Read before,
// such a device was granted by neither (Assigned found no role yet) until
// the next reconcile, which comes with the next reconnect to Mosquitto.
//
// The lock is this process's only: another replica's Assigned still finds
// no role while the role is being made from the first read. So once the
// account is made, what the bridge serves is read again, and each device
// that joined or left it in between is synced and settled as a move's
// (bug 238). A device that is the same in both reads was written as the
// second read says, by the creation or by a move made once the role was
// there, which settled itself (settle).
//
// The account is made only while the store has the bridge with secret,
// as a retry is (secretHeld). The creation can come late: the lock waits
// for a Reconcile, which on a fleet takes a while, or for requests
// Mosquitto is slow to answer. Meanwhile the bridge could be deleted and
// made again through another replica, and the late creation set the first
// secret on the new account: the secret the new bridge's 201 carried was
// refused, for good (docs/reliability.md, bug 254). The store is read and
// the account written with the account's lock held (lockAccount, bug
// 257), so that no creation comes between them.
func (d *Driver) BridgeCreated(ctx context.Context, bridgeID, secret string) error {
	d.change.Lock()
	defer d.change.Unlock()
	served, err := d.createBridge(ctx, account{kind: "bridge", username: bridgeID, password: secret,
		clientID: d.clientID(BridgeClientID(bridgeID)), role: BridgeRole(bridgeID), mark: secretMark(companion.HashSecret(secret))})
	switch {
	case errors.Is(err, errGone):
		d.log.Info("Mosquitto account not written: the bridge was deleted or made anew, or given another secret, since", "bridge_id", bridgeID)
		return nil
	case err != nil:
		return err
	}
	if err := d.syncMoved(ctx, bridgeID, served); err != nil {
		d.log.Error("Mosquitto ACL of a new bridge not updated; reconciling later", "bridge_id", bridgeID, "err", err)
		signal(d.kick)
		return err
	}
	return nil
}

// BridgeSecretChanged gives the bridge's account its new secret, as
// BridgeCreated makes an account: the client there gets the password and
// the mark of the secret (create), and Mosquitto closes the connections
// made with the old one (setClientId, sent with them, kicks the client's
// connections). An account that is not there is made: one whose creation
// failed while Mosquitto was away and whose retry, in memory, was lost
// with a restart of the server (docs/mosquitto.md). A failure is retried
// as a creation's is; a retry of the old secret finds the store holding
// the new one, and does nothing (secretHeld).
func (d *Driver) BridgeSecretChanged(ctx context.Context, bridgeID, secret string) error {
	return d.BridgeCreated(ctx, bridgeID, secret)
}

// errGone is lockHeld's answer when the store no longer has the account
// with the secret it was to be written with.
var errGone = errors.New("dynsec: the bridge was deleted or made anew, or given another secret, since")

// createBridge makes a bridge's account, with the account's lock held,
// and returns what the bridge served as its role was made. Run with
// d.change held.
//
// A read of the store that fails is retried as a failed write is: the API
// has answered 201 with the secret, and nothing else makes the account
// (docs/reliability.md, bug 256). The retry reads the store again
// (secretHeld), and Reconcile then gives the role what the bridge serves.
func (d *Driver) createBridge(ctx context.Context, a account) ([]string, error) {
	unlock, err := d.lockHeld(ctx, a)
	if err != nil {
		return nil, err
	}
	defer unlock()
	a.held = true
	served, err := d.st.ServedDevices(ctx, a.username)
	if err != nil {
		return nil, d.retryLater(a, err)
	}
	if a.acls, err = d.bridgeACLs(a.username, served); err != nil {
		d.log.Error("bridge account not created", "bridge_id", a.username, "err", err)
		return nil, err
	}
	return served, d.createAccountLocked(ctx, a)
}

// lockHeld takes the account's lock (lockAccount) and checks, under it,
// that the store still has the account with a's secret (secretHeld): the
// account may be written until unlock is called. It returns errGone when
// the store has not; a failure is queued for a retry (retryLater).
func (d *Driver) lockHeld(ctx context.Context, a account) (unlock func(), err error) {
	if unlock, err = d.lockAccount(ctx, a.username); err != nil {
		return nil, d.retryLater(a, err)
	}
	switch held, err := d.secretHeld(ctx, a); {
	case err != nil:
		unlock()
		return nil, d.retryLater(a, err)
	case !held:
		unlock()
		return nil, errGone
	}
	return unlock, nil
}

// syncMoved syncs each device that joined or left the bridge since it
// served the devices before. Run with d.change held.
func (d *Driver) syncMoved(ctx context.Context, bridgeID string, before []string) error {
	now, err := d.st.ServedDevices(ctx, bridgeID)
	if err != nil {
		return err
	}
	moved := make(map[string]bool, len(before))
	for _, dev := range before {
		moved[dev] = true
	}
	for _, dev := range now {
		moved[dev] = !moved[dev]
	}
	var errs []error
	for dev, ok := range moved {
		if ok {
			errs = append(errs, d.syncServed(ctx, bridgeID, dev))
		}
	}
	return errors.Join(errs...)
}

// BridgeDeleted removes a bridge's account and role: its connections are
// cut and its secret stops working.
//
// The deletion can come late: the lock waits for a Reconcile, which on a
// fleet takes a while, or for requests Mosquitto is slow to answer.
// Meanwhile the bridge could be made again through another replica, and
// the late deletion took the new bridge's account and role: the secret
// its 201 carried was refused (docs/reliability.md, bug 255). So the store
// is read first: a bridge made again keeps its role, and its client too
// if the client is the new bridge's, which its mark says (secretMark).
// A client of another secret is the deleted bridge's (the new one's
// creation has not come yet, or failed and waits for its retry), and
// goes. The store is read and the client written with the account's lock
// held (lockAccount, bug 257), so that no creation comes between them.
func (d *Driver) BridgeDeleted(ctx context.Context, bridgeID string) error {
	d.change.Lock()
	defer d.change.Unlock()
	unlock, err := d.lockAccount(ctx, bridgeID)
	if err == nil {
		var b companion.Bridge
		b, err = d.st.Bridge(ctx, bridgeID)
		switch {
		case errors.Is(err, companion.ErrNotFound):
			err = d.deleteBridge(ctx, bridgeID)
		case err == nil:
			_, err = d.deleteOlderClient(ctx, bridgeID, secretMark(b.SecretHash))
		}
		unlock()
	}
	if err != nil {
		d.log.Error("bridge account not deleted; reconciling later", "bridge_id", bridgeID, "err", err)
		signal(d.kick)
	}
	return err
}

// deleteBridge deletes the bridge's role, and its client if the server
// made it (a client of that name it did not make is left alone). Run with
// d.change held.
func (d *Driver) deleteBridge(ctx context.Context, bridgeID string) error {
	cmds := []Command{{"command": "deleteRole", "rolename": BridgeRole(bridgeID)}}
	switch _, err := d.ourClient(ctx, bridgeID, "bridge", BridgeRole(bridgeID)); {
	case err == nil:
		cmds = append([]Command{{"command": "deleteClient", "username": bridgeID}}, cmds...)
	case errors.Is(err, errNotOurs) || notFound(err):
	default:
		return err
	}
	rs, err := d.Do(ctx, cmds...)
	if err != nil {
		return err
	}
	for _, r := range rs {
		if err := r.Err(); err != nil && !notFound(err) {
			return err
		}
	}
	return nil
}

// lockAccount takes the store's lock of the account id, where the store
// has one (AccountLocker), and returns its release. The driver holds it
// from its last read of a bridge to its write of the bridge's account.
//
// The plugin cannot make a change on a condition ("delete this client if
// it is the one of that secret"), and a write of an account is not undone
// by a later one: a secret set or a client deleted is gone, and the
// server keeps only the secret's hash. So a replica that read the store
// and then wrote an account could write over a bridge deleted and made
// again through another replica between its read and its write: a
// reconcile deleted the new bridge's account, a creation retried set the
// former secret on it, and the secret of the new bridge's 201 was refused
// (docs/reliability.md, bug 257). Holding the lock that the store's
// creation of the bridge waits for from the read to the write, no bridge
// of that id is created in between; the new bridge's own creation, which
// comes after its store write, then writes last. (A deletion in between
// is harmless: its BridgeDeleted takes the lock too and writes after.)
// Taken under d.change, one account at a time: a replica holds one
// connection for it at most.
func (d *Driver) lockAccount(ctx context.Context, id string) (unlock func(), err error) {
	l, ok := d.st.(AccountLocker)
	if !ok {
		return func() {}, nil
	}
	return l.LockAccount(ctx, id)
}

// deleteOlderClient deletes the bridge's client unless its mark is mark:
// the client of a bridge deleted and made again, whose new account is
// not made yet, or of a bridge whose new secret's change of the account
// was lost. It says whether it deleted it. Run with d.change held.
func (d *Driver) deleteOlderClient(ctx context.Context, bridgeID, mark string) (bool, error) {
	return d.deleteClientNotMarked(ctx, "bridge", bridgeID, BridgeRole(bridgeID), mark, false)
}

// deleteClientNotMarked deletes the client username of kind, if the server
// made it (with role), unless its mark is mark; one with no mark too
// unless keepUnmarked. It says whether it deleted it. Run with d.change
// held.
func (d *Driver) deleteClientNotMarked(ctx context.Context, kind, username, role, mark string, keepUnmarked bool) (bool, error) {
	c, err := d.getOurClient(ctx, username, kind, role)
	switch {
	case errors.Is(err, errNotOurs) || notFound(err):
		return false, nil
	case err != nil:
		return false, err
	case c.TextDescription == mark, keepUnmarked && c.TextDescription == "":
		return false, nil
	}
	rs, err := d.Do(ctx, Command{"command": "deleteClient", "username": username})
	if err != nil {
		return false, err
	}
	if err := rs[0].Err(); err != nil && !notFound(err) {
		return false, err
	}
	return true, nil
}

// deleteOlderUserClient deletes the user's client if its mark is not that
// of the token the store has, read with the account's lock held: the
// token was replaced and the change of the account lost (a restart before
// its retry), and the old token, which the change was to end, still
// opened Mosquitto. The user needs another new token. A client made
// before tokens were marked (at the user's creation, until bug 298) is
// left alone: nothing tells whose token it has. Run with d.change held.
func (d *Driver) deleteOlderUserClient(ctx context.Context, userID string) error {
	unlock, err := d.lockAccount(ctx, userID)
	if err != nil {
		return err
	}
	defer unlock()
	u, err := d.st.User(ctx, userID)
	switch {
	case errors.Is(err, companion.ErrNotFound):
		return nil
	case err != nil:
		return err
	}
	deleted, err := d.deleteClientNotMarked(ctx, "user", userID, UserRole(userID), secretMark(u.TokenHash), true)
	if deleted {
		d.log.Warn("Mosquitto account of a user deleted: it has a token the user no longer has, whose change was lost; give the user a new token",
			"user_id", userID)
	}
	return err
}

// secretMark is the mark of a bridge's client (its text description): the
// start of its secret's SHA-256 as the store holds it, which tells the
// client of a bridge from that of a bridge deleted and made again under
// the same id (bug 255). Eight bytes tell two secrets apart, and say
// nothing of the secret itself.
func secretMark(secretHash []byte) string {
	return "secret " + hex.EncodeToString(secretHash[:min(8, len(secretHash))])
}

// Assigned makes the rights of the bridges a device moved between follow
// the store at once: the one it left loses the device's topics, the one it
// joined gets them. (Mosquitto also disconnects the clients of a role that
// changes; the bridge reconnects.) Only that device's rights change, as
// the store says with d.change held: a role made again from all the
// bridge's devices at each move made provisioning a bridge's devices take
// time in the square of their number (docs/performance.md, "Fleet-scale operations").
// Each bridge's grant is settled against a read made after it (bug 237).
// Reconcile repairs whatever else drifted.
func (d *Driver) Assigned(ctx context.Context, deviceID, from, to string) error {
	d.change.Lock()
	defer d.change.Unlock()
	var errs []error
	for _, bridge := range []string{from, to} {
		if bridge == "" || (bridge == from && from == to) {
			continue
		}
		if err := d.syncServed(ctx, bridge, deviceID); err != nil {
			errs = append(errs, err)
		}
	}
	err := errors.Join(errs...)
	if err != nil {
		d.log.Error("Mosquitto ACL not updated; reconciling later", "device_id", deviceID, "from", from, "to", to, "err", err)
		signal(d.kick)
	}
	return err
}

// serves reads whether the store says the bridge serves the device.
func (d *Driver) serves(bridgeID, deviceID string) func(context.Context) (bool, error) {
	return func(ctx context.Context) (bool, error) { return d.st.BridgeServes(ctx, bridgeID, deviceID) }
}

// boundTo reads whether the store says the device is bound to the user.
func (d *Driver) boundTo(userID, deviceID string) func(context.Context) (bool, error) {
	return func(ctx context.Context) (bool, error) {
		b, err := d.st.Binding(ctx, deviceID)
		if errors.Is(err, companion.ErrNotFound) {
			return false, nil
		}
		return err == nil && b.UserID == userID, err
	}
}

// sync makes the role grant acls exactly when read says so: it reads, writes
// what it read, and settles.
func (d *Driver) sync(ctx context.Context, roleName string, acls []ACL, read func(context.Context) (bool, error)) error {
	granted, err := read(ctx)
	if err != nil {
		return err
	}
	if err := d.grant(ctx, roleName, acls, granted); err != nil {
		return err
	}
	return d.settle(ctx, roleName, acls, granted, read)
}

// settleRounds bounds settle: past it the store is still changing under
// the write, and the driver leaves the role to the change's own sync and
// to a reconcile (the caller's error schedules one).
const settleRounds = 5

// settle is run after a write that made the role grant acls (granted) or
// not, from a read of the store made before the write: it reads the store
// again and, while that read says otherwise, writes what it says.
//
// d.change serialises one process only. Several replicas share the store
// and Mosquitto (docs/scale-out.md), and a replica's read and its write
// could straddle another's: R2 read that D is U1's; through R1, U1 unbound
// D (R1 took D from U1) and U2 bound it (R1 gave it to U2); then R2 gave
// D's topics to U1, who read U2's device until the next reconcile, which
// comes with the next reconnect to Mosquitto (docs/reliability.md, bug
// 237). A read after the write closes that: the plugin applies commands
// one at a time, so for one role and device some write is the last; its
// writer reads the store after the plugin applied it. A store change
// committed before that read is in the read, which then agrees with what
// was written or the writer writes again (and that write is the last);
// one committed after it is followed by its own replica's sync, whose
// write comes later, so it was not the last. So the last write, once
// settled, agrees with a read of the store made after every change before
// it. A user's rights are exact (each device's topics are its own), so
// each settles alone; the cost is one more read of the store per role a
// change touches.
func (d *Driver) settle(ctx context.Context, roleName string, acls []ACL, granted bool, read func(context.Context) (bool, error)) error {
	for range settleRounds {
		now, err := read(ctx)
		if err != nil || now == granted {
			return err
		}
		if err := d.grant(ctx, roleName, acls, now); err != nil {
			return err
		}
		granted = now
	}
	return fmt.Errorf("dynsec: %s: the store kept changing under %d writes; reconciling later", roleName, settleRounds)
}

// grant adds acls to the role, or removes them from it (receive rules
// first, so that access is cut before anything else goes).
func (d *Driver) grant(ctx context.Context, roleName string, acls []ACL, add bool) error {
	if !add {
		return d.apply(ctx, diff(roleName, acls, nil))
	}
	cmds := make([]Command, 0, len(acls))
	for _, a := range acls {
		cmds = append(cmds, addACL(roleName, a))
	}
	return d.apply(ctx, cmds)
}

// syncServed makes a bridge's role grant the device's topics exactly when
// the store says the bridge serves it. Run with d.change held.
func (d *Driver) syncServed(ctx context.Context, bridgeID, deviceID string) error {
	acls, err := d.servedDeviceACLs(deviceID)
	if err != nil {
		return err
	}
	err = d.sync(ctx, BridgeRole(bridgeID), acls, d.serves(bridgeID, deviceID))
	if noRole(err) {
		d.log.Warn("bridge has no Mosquitto account; its devices' topics are not granted", "bridge_id", bridgeID)
		return nil
	}
	return err
}

// UserCreated gives a new user a Mosquitto account that may read nothing
// until they bind a device. The client has the token's mark, as one whose
// token was changed has (UserTokenChanged): made without it, the client
// of a user whose first change of token was lost with a restart kept the
// old token, and Reconcile, which tells a stale client by its mark, left
// it (docs/reliability.md, bug 298).
func (d *Driver) UserCreated(ctx context.Context, userID, token string) error {
	return d.createAccount(ctx, account{kind: "user", username: userID, password: token,
		clientID: d.clientID(UserClientID(userID)), role: UserRole(userID), mark: secretMark(companion.HashSecret(token))})
}

// UserTokenChanged gives the user's account their new token: the client
// gets the password and the token's mark, and Mosquitto closes the
// connections made with the old one (create: setClientId kicks them). The
// role is left as it is: it is the user's bindings', which Bound, Unbound
// and Reconcile keep. An account that is not there (its creation lost with
// a restart, as a bridge's can be) is made, and given the topics of each
// device bound to the user. The store is read and the account written
// with the account's lock held, as for a bridge (lockAccount): a late
// change with an older token sets nothing (secretHeld). A failure is
// retried as a creation's is; should the server stop first, Reconcile
// deletes the client that still has the old token (its mark is not the
// store's), and the user needs another new token.
func (d *Driver) UserTokenChanged(ctx context.Context, userID, token string) error {
	d.change.Lock()
	defer d.change.Unlock()
	a := account{kind: "user", username: userID, password: token, clientID: d.clientID(UserClientID(userID)),
		role: UserRole(userID), mark: secretMark(companion.HashSecret(token))}
	unlock, err := d.lockHeld(ctx, a)
	switch {
	case errors.Is(err, errGone):
		d.log.Info("Mosquitto account not changed: the user's token was replaced again since", "user_id", userID)
		return nil
	case err != nil:
		return err
	}
	defer unlock()
	a.held = true
	_, err = d.getOurClient(ctx, userID, a.kind, a.role)
	lost := notFound(err)
	if err != nil && !lost {
		if errors.Is(err, errNotOurs) {
			d.log.Error("account not changed", "kind", a.kind, "username", userID, "err", err)
			return err
		}
		return d.retryLater(a, err)
	}
	if err := d.createAccountLocked(ctx, a); err != nil {
		return err
	}
	if !lost {
		return nil
	}
	bs, err := d.st.ListBindings(ctx, userID, "", 0)
	if err != nil {
		signal(d.kick) // Reconcile grants them
		return err
	}
	var errs []error
	for _, b := range bs {
		errs = append(errs, d.syncBindingLocked(ctx, userID, b.DeviceID))
	}
	if err := errors.Join(errs...); err != nil {
		signal(d.kick)
		return err
	}
	return nil
}

// DisconnectPublishesWill says that Mosquitto's plugin disconnects the
// clients of a role that changed without their Will: the server publishes
// the Will of a bridge not back within a grace (api.WillOnDisconnect).
func (d *Driver) DisconnectPublishesWill() bool { return false }

// Bound grants the user the topics of the device, if the store still says
// it is theirs.
func (d *Driver) Bound(ctx context.Context, userID, deviceID string) error {
	return d.syncBinding(ctx, userID, deviceID)
}

// Unbound takes the topics of the device from the user, unless the store
// says it is theirs again. The plugin also disconnects the user's clients
// when their role changes, and checks every delivery: nothing more of the
// device reaches them.
func (d *Driver) Unbound(ctx context.Context, userID, deviceID string) error {
	return d.syncBinding(ctx, userID, deviceID)
}

var errNotOurs = errors.New("dynsec: a client of that name exists in Mosquitto and was not made by the server; not touching it")

func (d *Driver) createAccount(ctx context.Context, a account) error {
	d.change.Lock()
	defer d.change.Unlock()
	return d.createAccountLocked(ctx, a)
}

// createAccountLocked is createAccount with d.change held.
func (d *Driver) createAccountLocked(ctx context.Context, a account) error {
	if a.username == d.opts.ServerUsername {
		err := fmt.Errorf("dynsec: a %s named %q would take the server's own Mosquitto account; not created", a.kind, a.username)
		d.log.Error("account not created", "kind", a.kind, "username", a.username, "err", err)
		return err
	}
	err := d.create(ctx, a)
	switch {
	case err == nil:
		d.log.Info("Mosquitto account created", "kind", a.kind, "username", a.username)
	case errors.Is(err, errNotOurs):
		d.log.Error("account not created", "kind", a.kind, "username", a.username, "err", err)
	default:
		d.retryLater(a, err)
	}
	return err
}

// retryLater queues a creation that failed with err for a retry while the
// process runs, and returns err.
//
// A creation the store held as it was made (a.held) replaces the retries
// of its account queued before: each change of a secret or token while
// Mosquitto was away queued one, the list growing until it was back,
// though only the store's would be made (secretHeld; docs/reliability.md,
// bug 363). Their passwords were stored before their changes were made,
// so before this one's (changes are made one at a time, d.change) read
// the store holding a's: the store had replaced them. A creation not read
// so (the store or its lock away) replaces none: which of it and an
// earlier one the store holds is not known.
func (d *Driver) retryLater(a account, err error) error {
	d.log.Error("account not created; retrying while the server runs", "kind", a.kind, "username", a.username, "err", err)
	d.mu.Lock()
	if a.held {
		d.retry = slices.DeleteFunc(d.retry, func(r account) bool { return r.kind == a.kind && r.username == a.username })
	}
	d.retry = append(d.retry, a)
	d.mu.Unlock()
	signal(d.kick)
	return err
}

// create makes the role and the client. Run with d.change held.
//
// The role is made with at most applyBatch of its ACLs, the rest added in
// batches: a bridge's role has five for each device it serves, and one
// createRole of them all, past a few hundred devices, is over Mosquitto's
// max_packet_size, which disconnects the server (docs/reliability.md, bug
// 138).
func (d *Driver) create(ctx context.Context, a account) error {
	first := a.acls[:min(len(a.acls), applyBatch)]
	acls := make([]map[string]any, 0, len(first))
	for _, x := range first {
		acls = append(acls, map[string]any{"acltype": x.Type, "topic": x.Topic, "allow": true, "priority": 0})
	}
	var rest []Command
	for _, x := range a.acls[len(first):] {
		rest = append(rest, addACL(a.role, x))
	}
	rs, err := d.Do(ctx,
		Command{"command": "createRole", "rolename": a.role, "acls": acls},
		withClientID(withMark(Command{"command": "createClient", "username": a.username, "password": a.password,
			"textname": "companion " + a.kind}, a.mark), a.clientID),
	)
	if err != nil {
		return err
	}
	if err := rs[0].Err(); err != nil {
		if !alreadyExists(err) {
			return err
		}
		// A role left from before: make its ACLs right. A user's are
		// their bindings', which the account does not carry (a.acls is
		// empty): syncBinding and Reconcile keep them.
		if a.kind == "bridge" {
			if err := d.syncRole(ctx, a.role, a.acls); err != nil {
				return err
			}
		}
	} else if err := d.apply(ctx, rest); err != nil {
		return err
	}
	err = rs[1].Err()
	if err == nil {
		// The role is given with addClientRole rather than in createClient:
		// Mosquitto 2.0.11 then links the client to the role both ways,
		// which it needs to disconnect the client when the role changes.
		return d.addRole(ctx, a)
	}
	if !alreadyExists(err) {
		return err
	}
	// The client exists. If it is ours (only our role), set the password
	// and its mark, and pin the client id (a client made before ids were
	// pinned).
	roles, err := d.ourClient(ctx, a.username, a.kind, a.role)
	if err != nil {
		return err
	}
	cmds := []Command{
		{"command": "setClientPassword", "username": a.username, "password": a.password},
		withClientID(Command{"command": "setClientId", "username": a.username}, a.clientID),
	}
	if a.mark != "" {
		cmds = append(cmds, Command{"command": "modifyClient", "username": a.username, "textdescription": a.mark})
	}
	rs, err = d.Do(ctx, cmds...)
	if err != nil {
		return err
	}
	for _, r := range rs {
		if err := r.Err(); err != nil {
			return err
		}
	}
	if roles == 0 { // an earlier attempt stopped half-way
		return d.addRole(ctx, a)
	}
	return nil
}

// NameTaken reports whether Mosquitto holds a client named name that the
// server did not make (api.AccountNames): an operator's, made by hand,
// which the server never touches. A bridge of that id got a secret that
// opened nothing (docs/reliability.md, bug 500).
func (d *Driver) NameTaken(ctx context.Context, name string) (bool, error) {
	// As a bridge's: a user's id is no bridge's (the store refuses it).
	_, err := d.getOurClient(ctx, name, "bridge", BridgeRole(name))
	switch {
	case errors.Is(err, errNotOurs):
		return true, nil
	case err == nil || notFound(err):
		return false, nil
	}
	return false, err
}

// ourClient checks that the client named username is one the server made:
// of its kind, with no role but role. It returns how many roles it has, or
// errNotOurs, or the plugin's "not found".
func (d *Driver) ourClient(ctx context.Context, username, kind, role string) (int, error) {
	c, err := d.getOurClient(ctx, username, kind, role)
	return len(c.Roles), err
}

// getOurClient is ourClient that returns the client.
func (d *Driver) getOurClient(ctx context.Context, username, kind, role string) (client, error) {
	rs, err := d.Do(ctx, Command{"command": "getClient", "username": username})
	if err != nil {
		return client{}, err
	}
	if err := rs[0].Err(); err != nil {
		return client{}, err
	}
	var got struct {
		Client client `json:"client"`
	}
	if err := json.Unmarshal(rs[0].Data, &got); err != nil {
		return client{}, err
	}
	if !got.Client.ours(kind, role) {
		return client{}, errNotOurs
	}
	return got.Client, nil
}

// client is a client as getClient and listClients report it.
type client struct {
	Username string `json:"username"`
	ClientID string `json:"clientid"`
	TextName string `json:"textname"`
	// TextDescription is a bridge's mark (secretMark).
	TextDescription string       `json:"textdescription"`
	Roles           []clientRole `json:"roles"`
	// Groups are the client's groups, whose roles it holds too (besides).
	Groups []struct {
		Name string `json:"groupname"`
	} `json:"groups"`
}

// ours says whether the server made c as an account of kind with role: its
// text name says so, and it has that role or none yet (a creation stopped
// half-way). Roles an operator gave it besides (named by besides) leave it
// the server's: taken for a client the server had not made, its new
// secret or token was never set, the old one, replaced as it leaked,
// opening Mosquitto still, and a deleted bridge's client stayed, with
// the old secret and the other roles' rights (docs/reliability.md, bug
// 499).
func (c client) ours(kind, role string) bool {
	return c.TextName == "companion "+kind &&
		(len(c.Roles) == 0 || slices.ContainsFunc(c.Roles, func(r clientRole) bool { return r.Name == role }))
}

// clientRole is one of a client's roles, as the plugin reports it.
type clientRole struct {
	Name string `json:"rolename"`
}

// clientID is the client id an account whose own is id is pinned to: id
// with Options.PinClientIDs, none ("") without.
func (d *Driver) clientID(id string) string {
	if !d.opts.PinClientIDs {
		return ""
	}
	return id
}

// withClientID sets cmd's clientid to id; with id "" the client has none
// (any client id; setClientId then takes a pinned one away).
func withClientID(cmd Command, id string) Command {
	if id != "" {
		cmd["clientid"] = id
	}
	return cmd
}

// withMark sets cmd's textdescription to mark, where there is one.
func withMark(cmd Command, mark string) Command {
	if mark != "" {
		cmd["textdescription"] = mark
	}
	return cmd
}

// pin returns the setClientId command that gives a client the server made
// the client id it should have (see clientID), or nil when it has it
// already or is not the server's.
func (d *Driver) pin(c client) Command {
	var want string
	switch {
	case c.ours("bridge", BridgeRole(c.Username)):
		want = d.clientID(BridgeClientID(c.Username))
	case c.ours("user", UserRole(c.Username)):
		want = d.clientID(UserClientID(c.Username))
	default:
		return nil
	}
	if c.ClientID == want {
		return nil
	}
	return withClientID(Command{"command": "setClientId", "username": c.Username}, want)
}

func (d *Driver) addRole(ctx context.Context, a account) error {
	rs, err := d.Do(ctx, Command{"command": "addClientRole", "username": a.username, "rolename": a.role})
	if err != nil {
		return err
	}
	return rs[0].Err()
}

// syncRole makes a role's ACLs exactly want, as listed by getRole.
func (d *Driver) syncRole(ctx context.Context, name string, want []ACL) error {
	rs, err := d.Do(ctx, Command{"command": "getRole", "rolename": name})
	if err != nil {
		return err
	}
	if err := rs[0].Err(); err != nil {
		return err
	}
	var got struct {
		Role role `json:"role"`
	}
	if err := json.Unmarshal(rs[0].Data, &got); err != nil {
		return err
	}
	return d.apply(ctx, diff(name, got.Role.ACLs, want))
}

// diff returns the commands that turn the ACLs have of a role into want:
// removals first, receive rules before subscribe rules, so that access is
// cut before it is granted anew.
func diff(roleName string, have, want []ACL) []Command {
	wantSet := make(map[ACL]bool, len(want))
	for _, a := range want {
		wantSet[a] = true
	}
	haveSet := make(map[ACL]bool, len(have))
	var cmds []Command
	for _, recvFirst := range []bool{true, false} {
		for _, a := range have {
			if (a.Type == PublishClientReceive) != recvFirst {
				continue
			}
			haveSet[a] = true
			if !wantSet[a] {
				cmds = append(cmds, removeACL(roleName, a))
			}
		}
	}
	for _, a := range want {
		if !haveSet[a] {
			haveSet[a] = true
			cmds = append(cmds, addACL(roleName, a))
		}
	}
	return cmds
}

// applyBatch is how many changes go in one request to the plugin: 100
// ACLs of a bridge's role are about 12 KiB, well within Mosquitto's
// max_packet_size (mosquitto.conf: 320 KiB).
const applyBatch = 100

// apply sends changes in batches; "already exists" on an add and "not
// found" on a removal mean the change is already made (and on a
// setClientId, that the client went meanwhile).
func (d *Driver) apply(ctx context.Context, cmds []Command) error {
	for len(cmds) > 0 {
		n := min(applyBatch, len(cmds))
		rs, err := d.Do(ctx, cmds[:n]...)
		if err != nil {
			return err
		}
		for _, r := range rs {
			if err := r.Err(); err != nil && !alreadyExists(err) && !((r.Command == "removeRoleACL" || r.Command == "setClientId") && notFound(err)) {
				return err
			}
		}
		cmds = cmds[n:]
	}
	return nil
}

// syncBinding makes the user's role grant the device's topics exactly when
// the store says the device is bound to them. It reads the store after
// taking d.change, so concurrent binds and unbinds end as the store does.
func (d *Driver) syncBinding(ctx context.Context, userID, deviceID string) error {
	d.change.Lock()
	defer d.change.Unlock()
	err := d.syncBindingLocked(ctx, userID, deviceID)
	if err != nil {
		d.log.Error("Mosquitto ACL not updated; reconciling later", "user_id", userID, "device_id", deviceID, "err", err)
		signal(d.kick)
	}
	return err
}

func (d *Driver) syncBindingLocked(ctx context.Context, userID, deviceID string) error {
	acls, err := d.deviceACLs(deviceID)
	if err != nil {
		return err
	}
	err = d.sync(ctx, UserRole(userID), acls, d.boundTo(userID, deviceID))
	if noRole(err) {
		d.log.Warn("user has no Mosquitto account; their devices' topics are not granted", "user_id", userID)
		return nil
	}
	return err
}

// Reconcile makes the plugin agree with the store: everything not granted
// is refused, every bridge-* role has a bridge's ACLs and every user-* role
// grants exactly the topics of the user's devices, and every client the
// server made has the client id it should have (BridgeClientID and
// UserClientID with Options.PinClientIDs, none without: a client whose id
// changes is disconnected once by the plugin). Account creations that
// failed earlier in this process are retried, a bridge's while the store
// still has it with that secret (secretHeld). Passwords are not
// reconciled: the server does not know them after the creation.
func (d *Driver) Reconcile(ctx context.Context) error {
	d.change.Lock()
	defer d.change.Unlock()
	if d.isUnanswered() {
		// Ask the plugin again (bug 268); an answer lets every change
		// through.
		rs, err := d.do(ctx, true, []Command{DenyByDefault()})
		if err != nil {
			return err
		}
		if err := rs[0].Err(); err != nil {
			return err
		}
	}
	d.mu.Lock()
	retry := d.retry
	d.retry = nil
	d.mu.Unlock()
	var failed []account
	for _, a := range retry {
		switch created, err := d.retryCreate(ctx, a); {
		case err != nil && !errors.Is(err, errNotOurs):
			failed = append(failed, a)
		case !created:
			d.log.Info("Mosquitto account not retried: the bridge was deleted or made anew, or the secret replaced, since", "kind", a.kind, "username", a.username)
		case err == nil:
			d.log.Info("Mosquitto account created on retry", "kind", a.kind, "username", a.username)
			if a.kind == "bridge" && d.opts.DisconnectedWithoutWill != nil {
				d.opts.DisconnectedWithoutWill(a.username)
			}
		}
	}
	if len(failed) > 0 {
		d.mu.Lock()
		d.retry = append(failed, d.retry...)
		d.mu.Unlock()
	}

	rs, err := d.Do(ctx, DenyByDefault(),
		Command{"command": "listRoles", "verbose": true, "count": -1, "offset": 0},
		Command{"command": "listClients", "verbose": true, "count": -1, "offset": 0})
	if err != nil {
		return err
	}
	for _, r := range rs {
		if err := r.Err(); err != nil {
			return err
		}
	}
	var list struct {
		Roles []role `json:"roles"`
	}
	if err := json.Unmarshal(rs[1].Data, &list); err != nil {
		return fmt.Errorf("dynsec: listRoles: %w", err)
	}
	var clients struct {
		Clients []client `json:"clients"`
	}
	if err := json.Unmarshal(rs[2].Data, &clients); err != nil {
		return fmt.Errorf("dynsec: listClients: %w", err)
	}
	d.besides(clients.Clients)
	var pins []Command
	marks := map[string]string{}    // bridge → its client's mark
	userMarked := map[string]bool{} // user → their client has a mark
	for _, c := range clients.Clients {
		if p := d.pin(c); p != nil {
			pins = append(pins, p)
		}
		if c.ours("bridge", BridgeRole(c.Username)) {
			marks[c.Username] = c.TextDescription
		}
		if c.ours("user", UserRole(c.Username)) {
			userMarked[c.Username] = c.TextDescription != ""
		}
	}
	if err := d.apply(ctx, pins); err != nil {
		return err
	}
	if len(pins) > 0 {
		d.log.Info("Mosquitto clients pinned to their client ids", "clients", len(pins))
	}
	var cmds []Command
	var written []settling
	for _, r := range list.Roles {
		var want []ACL
		var aclsOf func(deviceID string) ([]ACL, error)
		var read func(deviceID string) func(context.Context) (bool, error)
		switch {
		case strings.HasPrefix(r.Name, "bridge-"):
			id := strings.TrimPrefix(r.Name, "bridge-")
			if !topics.ValidBridgeID(id) {
				continue
			}
			b, err := d.st.Bridge(ctx, id)
			switch {
			case errors.Is(err, companion.ErrNotFound):
				// Deleted while Mosquitto was away.
				if _, err := d.deleteGoneBridge(ctx, id); err != nil {
					return err
				}
				continue
			case err != nil:
				return err
			}
			if m := marks[id]; m != "" && m != secretMark(b.SecretHash) {
				// Deleted while Mosquitto was away, and made again, or
				// given a new secret; the new account is not made yet
				// (bug 258), or its change was lost. A client made
				// before clients were marked is left alone: nothing
				// tells whose secret it has. A client deleted had its
				// connections closed without their Will (bug 303).
				switch deleted, err := d.deleteGoneBridge(ctx, id); {
				case err != nil:
					return err
				case deleted && d.opts.DisconnectedWithoutWill != nil:
					d.opts.DisconnectedWithoutWill(id)
				}
			}
			if want, err = d.BridgeACLs(ctx, id); err != nil {
				return err
			}
			aclsOf = d.servedDeviceACLs
			read = func(dev string) func(context.Context) (bool, error) { return d.serves(id, dev) }
		case strings.HasPrefix(r.Name, "user-"):
			user := strings.TrimPrefix(r.Name, "user-")
			if userMarked[user] {
				if err := d.deleteOlderUserClient(ctx, user); err != nil {
					return err
				}
			}
			aclsOf = d.deviceACLs
			read = func(dev string) func(context.Context) (bool, error) { return d.boundTo(user, dev) }
			bs, err := d.st.ListBindings(ctx, user, "", 0)
			if err != nil {
				return err
			}
			for _, b := range bs {
				acls, err := d.deviceACLs(b.DeviceID)
				if err != nil {
					return err
				}
				want = append(want, acls...)
			}
		default:
			continue
		}
		changes := diff(r.Name, r.ACLs, want)
		cmds = append(cmds, changes...)
		// What was read of each device whose rights change is settled
		// after the write, as a single change's (bug 237): only those
		// devices are read again, not the fleet.
		wanted := map[string]bool{}
		for _, a := range want {
			wanted[d.deviceOf(a.Topic)] = true
		}
		seen := map[string]bool{}
		for _, c := range changes {
			dev := d.deviceOf(fmt.Sprint(c["topic"]))
			if dev == "" || seen[dev] {
				continue
			}
			seen[dev] = true
			acls, err := aclsOf(dev)
			if err != nil {
				return err
			}
			written = append(written, settling{role: r.Name, acls: acls, granted: wanted[dev], read: read(dev)})
		}
	}
	if err := d.apply(ctx, cmds); err != nil {
		return err
	}
	if len(cmds) > 0 {
		d.log.Info("Mosquitto ACLs reconciled with the store", "changes", len(cmds))
	}
	var errs []error
	for _, w := range written {
		if err := d.settle(ctx, w.role, w.acls, w.granted, w.read); err != nil && !noRole(err) { // a role gone meanwhile grants nothing
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if len(failed) > 0 {
		return fmt.Errorf("dynsec: %d account(s) still not created", len(failed))
	}
	return nil
}

// retryCreate makes an account whose creation failed, while the store
// still has it (secretHeld), read with the account's lock held
// (lockAccount). It says whether it made it.
func (d *Driver) retryCreate(ctx context.Context, a account) (bool, error) {
	unlock, err := d.lockAccount(ctx, a.username)
	if err != nil {
		return false, err
	}
	defer unlock()
	held, err := d.secretHeld(ctx, a)
	if err != nil || !held {
		return false, err
	}
	return true, d.create(ctx, a)
}

// deleteGoneBridge deletes the account of a bridge the store no longer
// has, read again with the account's lock held (lockAccount); of a bridge
// the store has again, the client only, if it is the deleted bridge's
// (deleteOlderClient). Reconcile keeps no client of a deleted bridge: one
// left when the bridge was made again through a replica that stopped
// before it made the new account (whose retry, in memory, went with it)
// took the deleted bridge's secret for good (docs/reliability.md, bug
// 258).
//
// It says whether it deleted the client of a bridge the store has.
func (d *Driver) deleteGoneBridge(ctx context.Context, bridgeID string) (bool, error) {
	unlock, err := d.lockAccount(ctx, bridgeID)
	if err != nil {
		return false, err
	}
	defer unlock()
	switch b, err := d.st.Bridge(ctx, bridgeID); {
	case err == nil: // made again meanwhile: as BridgeDeleted does
		return d.deleteOlderClient(ctx, bridgeID, secretMark(b.SecretHash))
	case !errors.Is(err, companion.ErrNotFound):
		return false, err
	}
	return false, d.deleteBridge(ctx, bridgeID)
}

// secretHeld says whether a creation to retry is still the store's: a
// user's always (a user is never made again), a bridge's while the store
// has the bridge with the secret it was made with. Retried after the
// bridge was deleted and made anew with a new secret, on this replica or
// another, it set the old secret, which the store no longer held: the
// bridge's new one stopped working, for good (bug 239). The store holds
// the SHA-256 of the secret, as the API made it (api.newSecret).
func (d *Driver) secretHeld(ctx context.Context, a account) (bool, error) {
	if a.kind != "bridge" {
		// A user's while the store has their token: a change of it
		// (UserTokenChanged) made on this replica or another, before a
		// retry of the token it replaced, was undone by the retry.
		u, err := d.st.User(ctx, a.username)
		if errors.Is(err, companion.ErrNotFound) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		return companion.SecretMatches(a.password, u.TokenHash), nil
	}
	b, err := d.st.Bridge(ctx, a.username)
	if errors.Is(err, companion.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return companion.SecretMatches(a.password, b.SecretHash), nil
}

// settling is a device's rights in a role as Reconcile wrote them, to
// settle against the store once written.
type settling struct {
	role    string
	acls    []ACL
	granted bool
	read    func(context.Context) (bool, error)
}

// deviceOf returns the device whose topics topic is of, or "" for none.
func (d *Driver) deviceOf(topic string) string {
	rest, ok := strings.CutPrefix(topic, d.tree.Prefix()+"/devices/")
	if !ok {
		return ""
	}
	dev, _, _ := strings.Cut(rest, "/")
	if !topics.ValidDeviceID(dev) {
		return ""
	}
	return dev
}

// run reconciles on every connect, and again RetryInterval after a failure.
// A failure while a retry is already due does not put it off: with a
// change failing more often than RetryInterval (every one, while the
// plugin's answer is awaited since a request went unanswered, bug 268),
// each pushed the retry back, and nothing was reconciled nor asked of the
// plugin again while the changes went on (docs/reliability.md, bug 270).
func (d *Driver) run() {
	defer d.wg.Done()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d.wg.Add(1)
	go func() { // cancels the request in flight when Close is called
		defer d.wg.Done()
		select {
		case <-d.quit:
			cancel()
		case <-ctx.Done():
		}
	}()
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	due := false // retry is armed
	check := time.NewTicker(d.opts.CheckInterval)
	defer check.Stop()
	for {
		select {
		case <-d.quit:
			retry.Stop()
			return
		case <-check.C:
			if !due {
				d.check(ctx)
			}
			continue
		case <-d.connected:
		case <-d.kick:
			if !due {
				due = true
				retry.Reset(d.opts.RetryInterval)
			}
			continue
		case <-retry.C:
		}
		retry.Stop() // a reconnect's reconciling serves for the retry due
		due = false
		if err := d.Reconcile(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			d.log.Error("reconciling Mosquitto's accounts failed; retrying", "err", err, "in", d.opts.RetryInterval)
			due = true
			retry.Reset(d.opts.RetryInterval)
		}
	}
}
