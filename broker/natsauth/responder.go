// Package natsauth is the companion server's side of NATS Server's auth
// callout: the broker door of CONTRACT §3 and §9 on a NATS cluster. Every
// MQTT client that logs in to a node is sent by NATS to the responder
// ($SYS.REQ.USER.AUTH), which checks the credentials against the store as
// broker.Accounts does for the embedded broker and answers a user JWT,
// signed with the callout's issuer key, whose publish and subscribe allow
// lists are the NATS subjects of that client's rights. When an assignment
// changes or a device is unbound, the responder closes the affected
// clients' connections through the system account so that they log in
// again and get the new rights (api.BrokerAccounts); a device bound only
// adds rights, which come with the user's next login (bug 349).
//
// It is not a NATS authorization service for anything but the service's
// MQTT clients (the JWT allows MQTT connections only), and it keeps no
// state: rights are read from the store at each login, and who holds the
// client's MQTT client id from the cluster's nodes. docs/scale-out.md
// shows the NATS configuration it expects.
package natsauth

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/broker"
	"github.com/devicecompanion/companion/broker/embedded"
	"github.com/devicecompanion/companion/internal/logevery"
	"github.com/devicecompanion/companion/topics"
)

// Subject is where NATS Server sends its authorization requests.
const Subject = "$SYS.REQ.USER.AUTH"

// DefaultAccount is the NATS account MQTT clients are placed in unless
// Options.Account names another. It must have JetStream enabled.
const DefaultAccount = "COMPANION"

// DefaultQueue is the queue group the responders of all server replicas
// share, so that each request is answered once.
const DefaultQueue = "companion-auth"

// Store is what the responder needs of the store: credentials (as
// broker.Accounts reads them), which devices a bridge serves and which a
// user owns.
type Store interface {
	broker.AccountStore
	ServedDevices(ctx context.Context, bridgeID string) ([]string, error)
	ListBindings(ctx context.Context, userID, after string, limit int) ([]companion.Binding, error)
}

// Options configure New. The zero value of each optional field means its
// default.
type Options struct {
	// URL is the cluster's NATS client URL, or a comma-separated list of
	// its nodes (nats://host:4222,…). Required.
	URL string
	// User and Password log the responder in as one of auth_callout's
	// auth_users, in the callout's account. Required.
	User, Password string
	// SystemUser and SystemPassword log in to the system account, to find
	// (CONNZ) and close (KICK) the connections whose rights changed.
	// Without them rights change only when a client next logs in.
	SystemUser, SystemPassword string
	// Issuer is the account key pair whose public key is auth_callout's
	// issuer: it signs the answers and the user JWTs. Required.
	Issuer nkeys.KeyPair
	// Account is the NATS account MQTT clients are placed in (the user
	// JWT's audience); default DefaultAccount.
	Account string
	Store   Store // required
	// ServerUsername and ServerPassword are the companion server's own
	// MQTT account (--mqtt-username, --mqtt-password): everything under
	// the prefix. Required; every replica must use the same.
	ServerUsername, ServerPassword string
	Topics                         topics.Tree // default topics.DefaultPrefix
	// TLSConfig, when set, is used for the NATS connections (tls:// URLs).
	TLSConfig *tls.Config
	Queue     string        // default DefaultQueue
	Workers   int           // requests answered at once; default 8
	Timeout   time.Duration // store reads of one request, one kick; default 5s
	// RetryInterval is how soon closing the connections of an account
	// whose rights changed is tried again after it failed; default 2s.
	RetryInterval time.Duration
	Logger        *slog.Logger
}

// Responder answers NATS's authorization requests. Create it with New,
// stop it with Close.
type Responder struct {
	opts     Options // defaults filled in
	accounts broker.Accounts
	log      *slog.Logger
	// noisy logs a source's refused logins once a minute per reason:
	// anyone who reaches a node's MQTT port can be refused as fast as it
	// connects (bug 382).
	noisy *logevery.Log

	serverUser, serverPass []byte // companion.HashSecret of the server's login

	auth *nats.Conn // in the callout's account
	sys  *nats.Conn // in the system account; nil without SystemUser
	sub  *nats.Subscription
	sem  chan struct{} // one token per request being answered

	// answered, when set (by tests), is called once an answer is sent,
	// before the login is let go.
	answered atomic.Pointer[func(refused bool)]

	// changed is the subscription to the other replicas' changes of
	// rights (onChanged); id names this responder in its own notices
	// (tellChanged).
	changed *nats.Subscription
	id      string

	mu       sync.Mutex
	closed   bool
	pending  map[string]bool            // usernames whose connections are still to be closed
	logins   map[string]map[*login]bool // by username: logins being answered or lately let in
	byClient map[string]map[*login]bool // the same, by MQTT client id
	settling []*login                   // the logins let in, oldest first
	begun    uint64                     // logins begun: the last one's login.seq
	retry    chan struct{}
	// ctx is done once Close is called: it stops the loops and cancels
	// the kicks under way (quit).
	ctx  context.Context
	quit context.CancelFunc
	wg   sync.WaitGroup
	once sync.Once
}

// New checks the options, connects to the cluster (retrying in the
// background while it cannot) and starts answering.
func New(opts Options) (*Responder, error) {
	switch {
	case opts.URL == "":
		return nil, errors.New("natsauth: no NATS URL")
	case opts.User == "" || opts.Password == "":
		return nil, errors.New("natsauth: the callout's auth user and password are required")
	case opts.Issuer == nil:
		return nil, errors.New("natsauth: no issuer key")
	case opts.Store == nil:
		return nil, errors.New("natsauth: no store")
	case opts.ServerUsername == "" || opts.ServerPassword == "":
		return nil, errors.New("natsauth: the server's MQTT username and password are required")
	case (opts.SystemUser == "") != (opts.SystemPassword == ""):
		return nil, errors.New("natsauth: the system user and password go together")
	}
	pub, err := opts.Issuer.PublicKey()
	if err != nil {
		return nil, fmt.Errorf("natsauth: issuer: %w", err)
	}
	if !nkeys.IsValidPublicAccountKey(pub) {
		return nil, fmt.Errorf("natsauth: the issuer must be an account key (a seed starting SA), not %.1s…", pub)
	}
	if opts.Account == "" {
		opts.Account = DefaultAccount
	}
	if opts.Topics == (topics.Tree{}) {
		opts.Topics = topics.MustNew(topics.DefaultPrefix)
	}
	if opts.Queue == "" {
		opts.Queue = DefaultQueue
	}
	if opts.Workers <= 0 {
		opts.Workers = 8
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 5 * time.Second
	}
	if opts.RetryInterval <= 0 {
		opts.RetryInterval = 2 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	r := &Responder{
		opts:       opts,
		accounts:   broker.Accounts{Store: opts.Store},
		log:        opts.Logger.With("component", "natsauth"),
		noisy:      logevery.New(opts.Logger.With("component", "natsauth"), time.Minute, nil),
		serverUser: companion.HashSecret(opts.ServerUsername),
		serverPass: companion.HashSecret(opts.ServerPassword),
		sem:        make(chan struct{}, opts.Workers),
		pending:    map[string]bool{},
		logins:     map[string]map[*login]bool{},
		byClient:   map[string]map[*login]bool{},
		retry:      make(chan struct{}, 1),
	}
	r.ctx, r.quit = context.WithCancel(context.Background())
	r.auth, err = r.connect("companion auth callout", opts.User, opts.Password)
	if err != nil {
		return nil, err
	}
	if r.sub, err = r.auth.QueueSubscribe(Subject, opts.Queue, r.onRequest); err != nil {
		r.auth.Close()
		return nil, fmt.Errorf("natsauth: subscribe to %s: %w", Subject, err)
	}
	r.id = nats.NewInbox()
	if r.changed, err = r.auth.Subscribe(changedSubject, r.onChanged); err != nil {
		r.auth.Close()
		return nil, fmt.Errorf("natsauth: subscribe to %s: %w", changedSubject, err)
	}
	if opts.SystemUser != "" {
		if r.sys, err = r.connect("companion auth callout (system)", opts.SystemUser, opts.SystemPassword); err != nil {
			r.auth.Close()
			return nil, err
		}
	}
	r.goroutine(r.retryLoop)
	return r, nil
}

// connect opens a NATS connection that retries for as long as it is
// open, the first connect included.
func (r *Responder) connect(name, user, pass string) (*nats.Conn, error) {
	log := r.log.With("conn", name)
	opts := []nats.Option{
		nats.Name(name),
		nats.UserInfo(user, pass),
		nats.RetryOnFailedConnect(true),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(500 * time.Millisecond),
		nats.ConnectHandler(func(nc *nats.Conn) { log.Info("connected to NATS", "server", nc.ConnectedUrlRedacted()) }),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("reconnected to NATS", "server", nc.ConnectedUrlRedacted()) }),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("disconnected from NATS", "err", err)
			}
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { log.Error("NATS", "err", err) }),
	}
	if r.opts.TLSConfig != nil {
		opts = append(opts, nats.Secure(r.opts.TLSConfig))
	}
	nc, err := nats.Connect(r.opts.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("natsauth: connect to %s: %w", r.opts.URL, err)
	}
	return nc, nil
}

// goroutine runs f on a goroutine Close waits for; after Close it does
// not run f and returns false.
func (r *Responder) goroutine(f func()) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		f()
	}()
	return true
}

// Close stops answering, waits for the answers under way and closes the
// connections.
func (r *Responder) Close() error {
	r.once.Do(func() {
		r.mu.Lock()
		r.closed = true
		r.mu.Unlock()
		r.quit()
		_ = r.sub.Unsubscribe()
		_ = r.changed.Unsubscribe()
		r.wg.Wait()
		r.auth.Close()
		if r.sys != nil {
			r.sys.Close()
		}
	})
	return nil
}

// onRequest hands a request to a goroutine of its own, at most
// Options.Workers at once; while all are busy NATS's client holds the
// requests that follow.
func (r *Responder) onRequest(m *nats.Msg) {
	select {
	case r.sem <- struct{}{}:
	case <-r.ctx.Done():
		return
	}
	if !r.goroutine(func() {
		defer func() { <-r.sem }()
		r.answer(m)
	}) {
		<-r.sem
	}
}

// answer decides one request and responds.
func (r *Responder) answer(m *nats.Msg) {
	req, err := jwt.DecodeAuthorizationRequestClaims(string(m.Data))
	if err != nil {
		r.log.Warn("authorization request not understood; not answered", "err", err)
		return
	}
	// The request's exp (NATS's timeout, in whole seconds of the node's
	// clock) is not used: a clock a little ahead would refuse everyone.
	ctx, cancel := context.WithTimeout(context.Background(), r.opts.Timeout)
	defer cancel()
	start := time.Now()
	l := r.beginLogin(req)
	let := false
	defer func() { r.endLogin(l, let) }()
	userJWT, who, refusal := r.decide(ctx, req, l)
	ci := req.ClientInformation
	log := r.log.With("username", req.ConnectOptions.Username, "client_id", ci.MQTT, "remote", ci.Host,
		"nats_server", req.Server.Name)
	resp := jwt.NewAuthorizationResponseClaims(req.UserNkey)
	resp.Audience = req.Server.ID
	if refusal != "" {
		resp.Error = refusal
		r.noisy.Log(slog.LevelInfo, refusal+"\x00"+ci.Host, "mqtt connect refused", "reason", refusal,
			"username", req.ConnectOptions.Username, "client_id", ci.MQTT, "remote", ci.Host, "nats_server", req.Server.Name)
	} else {
		resp.Jwt = userJWT
	}
	tok, err := resp.Encode(r.opts.Issuer)
	if err != nil {
		log.Error("authorization answer not signed", "err", err)
		return
	}
	if max := r.auth.MaxPayload(); max > 0 && int64(len(tok)) > max {
		// The rights do not fit in one NATS message: refuse, saying why.
		log.Error("mqtt connect refused: its rights exceed NATS's max_payload", "role", who.Role, "id", who.ID,
			"bytes", len(tok), "max_payload", max)
		refusal = fmt.Sprintf("the rights of %s %s do not fit in max_payload (%d bytes > %d)", who.Role, who.ID, len(tok), max)
		resp.Jwt, resp.Error = "", refusal
		if tok, err = resp.Encode(r.opts.Issuer); err != nil {
			return
		}
	}
	if ctx.Err() != nil {
		log.Warn("authorization answer too late; not sent", "role", who.Role, "id", who.ID, "took", time.Since(start))
		return
	}
	if refusal != "" {
		// Forgotten before the answer goes: the account whose client id
		// it asked for may log in at once, and a refused login still
		// listed refused that one too (earlierLoginWith; bug 247).
		r.endLogin(l, false)
	}
	if err := m.Respond([]byte(tok)); err != nil {
		log.Warn("authorization answer not sent", "err", err)
		return
	}
	if f := r.answered.Load(); f != nil {
		(*f)(refusal != "")
	}
	let = refusal == ""
	if refusal == "" {
		log.Debug("mqtt connect allowed", "role", who.Role, "id", who.ID, "bytes", len(tok), "took", time.Since(start))
	}
}

// decide authenticates the client and, when it may come in, returns its
// user JWT and identity; otherwise why not.
func (r *Responder) decide(ctx context.Context, req *jwt.AuthorizationRequestClaims, l *login) (string, embedded.Identity, string) {
	co := req.ConnectOptions
	if co.Username == "" || co.Password == "" {
		return "", embedded.Identity{}, "anonymous"
	}
	id, ok := r.authenticate(ctx, co.Username, co.Password)
	if !ok {
		return "", embedded.Identity{}, "bad credentials"
	}
	if !embedded.MayUseClientID(id, req.ClientInformation.MQTT) {
		return "", id, "client id belongs to another account"
	}
	if holder, err := r.clientIDHolder(ctx, req, l); err != nil {
		// The check keeps one account from closing another's connection;
		// it guards no data, so a cluster that cannot be asked does not
		// keep everyone out.
		r.log.Warn("client id not checked against the cluster's connections; connect allowed",
			"client_id", req.ClientInformation.MQTT, "err", err)
	} else if holder != "" {
		return "", id, "client id belongs to another account"
	}
	rt, err := r.rightsOf(ctx, id)
	if err != nil {
		r.log.Error("rights not read; connect refused", "role", id.Role, "id", id.ID, "err", err)
		return "", id, "rights not available"
	}
	uc := jwt.NewUserClaims(req.UserNkey)
	uc.Name = co.Username
	uc.Audience = r.opts.Account
	uc.AllowedConnectionTypes.Add(jwt.ConnectionTypeMqtt)
	// The lists are set, not Add-ed: Add checks each for repeats, which
	// takes seconds for a bridge of a thousand devices (rightsOf repeats
	// none). An empty allow list would allow everything.
	if len(rt.pub) > 0 {
		uc.Pub.Allow = jwt.StringList(rt.pub)
	} else {
		uc.Pub.Deny = jwt.StringList{">"}
	}
	if len(rt.sub) > 0 {
		uc.Sub.Allow = jwt.StringList(rt.sub)
	} else {
		uc.Sub.Deny = jwt.StringList{">"}
	}
	tok, err := uc.Encode(r.opts.Issuer)
	if err != nil {
		r.log.Error("user JWT not signed", "err", err)
		return "", id, "internal error"
	}
	return tok, id, ""
}

// authenticate checks the credentials: the server's own (compared as
// hashes in constant time, and never falling through to the store), then
// a bridge's or a user's, exactly as broker.Accounts does for the embedded
// broker.
func (r *Responder) authenticate(ctx context.Context, username, password string) (embedded.Identity, bool) {
	if companion.SecretMatches(username, r.serverUser) {
		return embedded.Identity{Role: embedded.RoleServer}, companion.SecretMatches(password, r.serverPass)
	}
	id, ok := r.accounts.Authenticate(ctx, username, password)
	if !ok || (id.Role != embedded.RoleBridge && id.Role != embedded.RoleUser) {
		return embedded.Identity{}, false
	}
	if id.Role == embedded.RoleBridge && !topics.ValidBridgeID(id.ID) {
		return embedded.Identity{}, false
	}
	return id, true
}
