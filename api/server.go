package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"runtime/debug"
	"sync"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/logevery"

	"github.com/gin-gonic/gin"
)

// Store is what the API needs of the store. *store.DB implements it.
type Store interface {
	CreateUser(ctx context.Context, u companion.User) error
	UserByTokenHash(ctx context.Context, hash []byte) (companion.User, error)
	SetUserToken(ctx context.Context, userID string, tokenHash []byte) error
	User(ctx context.Context, id string) (companion.User, error)

	ProvisionDevice(ctx context.Context, d companion.RegistryDevice) error
	RegistryDevice(ctx context.Context, id string) (companion.RegistryDevice, error)

	CreateBridge(ctx context.Context, b companion.Bridge) error
	Bridge(ctx context.Context, id string) (companion.Bridge, error)
	ServedDevices(ctx context.Context, bridgeID string) ([]string, error)
	BridgeBySecretHash(ctx context.Context, hash []byte) (companion.Bridge, error)
	// ListBridges reads a page of the owner's bridges, each with the
	// devices it serves, in one read, and whether more follow.
	ListBridges(ctx context.Context, ownerID, after string, limit int) ([]companion.ServingBridge, bool, error)
	// CountBridges counts the owner's bridges without their devices.
	CountBridges(ctx context.Context, ownerID string) (int, error)
	DeleteBridge(ctx context.Context, bridgeID, ownerID string) ([]string, error)
	SetBridgeSecret(ctx context.Context, bridgeID, ownerID string, secretHash []byte) error
	AssignDevice(ctx context.Context, deviceID, bridgeID, ownerID string) (string, error)
	BlobNeeded(ctx context.Context, sha, bridgeID string) (bool, error)

	Bind(ctx context.Context, b companion.Binding) (companion.Binding, bool, error)
	Unbind(ctx context.Context, deviceID, userID string) (companion.Unbound, error)
	Binding(ctx context.Context, deviceID string) (companion.Binding, error)
	// ListDevices reads a page of the user's devices with their statuses
	// in one read transaction.
	ListDevices(ctx context.Context, userID, after string, limit int) ([]companion.BoundDevice, error)

	Status(ctx context.Context, deviceID string) (companion.Status, error)
	Settings(ctx context.Context, deviceID string) (companion.Settings, error)

	Command(ctx context.Context, id string) (companion.Command, error)
	// ListCommands reads a page of a device's commands, filtered as it
	// walks, and whether more follow it.
	ListCommands(ctx context.Context, q companion.CommandQuery) (page []companion.Command, more bool, err error)

	Idempotency(ctx context.Context, userID, key string) (companion.Idempotency, error)
	PutIdempotency(ctx context.Context, rec companion.Idempotency) error

	PutFirmware(ctx context.Context, f companion.Firmware) error
	Firmware(ctx context.Context, model, version string) (companion.Firmware, error)
	Firmwares(ctx context.Context, model string) ([]companion.Firmware, error)

	PutAppRelease(ctx context.Context, r companion.AppRelease) error
	AppRelease(ctx context.Context, appID, version string) (companion.AppRelease, error)
	AppReleases(ctx context.Context, appID string) ([]companion.AppRelease, error)
	// AppCatalog reads a page of the app catalog, each app with its
	// versions, in one read, and whether more apps follow.
	AppCatalog(ctx context.Context, after string, limit int) ([]companion.CatalogApp, bool, error)

	PutBlob(ctx context.Context, r io.Reader, max int64) (companion.Blob, error)
	OpenBlob(ctx context.Context, sha string) (io.ReadSeekCloser, companion.Blob, error)
}

// Commander is what the API needs of the command broker.
type Commander interface {
	// Submit stores the command (queued, on disk) and hands it to the
	// broker. With idem set, a repeat of the same request returns the first
	// command and replayed = true. Errors: companion.ErrQueueFull,
	// companion.ErrIdemConflict.
	Submit(ctx context.Context, c companion.Command, idem *companion.Idempotency) (cmd companion.Command, replayed bool, err error)
	// Cancel cancels a command not yet delivered: broker.ErrNotCancelable or
	// companion.ErrFinal after, companion.ErrNotFound for an unknown id.
	Cancel(ctx context.Context, id string) (companion.Command, error)
	// Wait returns when the command is final or ctx is done, with the
	// command's latest state either way.
	Wait(ctx context.Context, id string) (companion.Command, error)
	// PrepareMove is called before devices' bridge changes in the store
	// (a move, or the deletion of the bridge that serves them): it waits
	// (a moment at most) for the word of their bridge on the commands on
	// their way to it, and holds their commands until release, called
	// once the store has the change or refused it.
	PrepareMove(deviceIDs ...string) (release func())
	// DeviceMoved says a device changed bridges (or lost its bridge): its
	// unfinished commands go to the bridge that serves it now.
	DeviceMoved(deviceID string)
	// BridgesDisconnecting says the broker's accounts are about to
	// disconnect the bridges for a change of their rights: they come back
	// at once, and the Will a broker publishes for them is held.
	BridgesDisconnecting(bridgeIDs ...string)
	// BridgesDisconnectingWithoutWill says the broker's accounts are about
	// to disconnect the bridges for a change of their rights, and the
	// broker publishes no Will for them: one not back within a grace has
	// its Will published for it.
	BridgesDisconnectingWithoutWill(bridgeIDs ...string)
	// BridgeDeleted says the bridge was deleted, once the broker's
	// accounts closed its connections: the broker forgets it.
	BridgeDeleted(bridgeID string)
	// Ended says the store ended these commands itself (an unbind): their
	// waiters are answered and the bridge is told to drop them.
	Ended(cmds []companion.Command)
}

// BrokerAccounts is told of every change to who may use the MQTT broker,
// after the store has it, so that the broker's accounts and ACLs follow:
// dynsec.Driver drives Mosquitto's dynamic-security plugin, NATS's
// callout disconnects the clients whose rights changed, and the embedded
// broker, which asks the store itself, only disconnects a bridge whose
// devices changed. It is nil with a broker the server does not manage
// (--mqtt-dynsec=false). Secrets are
// passed only here, at creation and at a bridge's new secret, since the
// store keeps only their hashes.
// Failures are the implementation's to log and retry: the API's answer
// does not depend on them.
type BrokerAccounts interface {
	UserCreated(ctx context.Context, userID, token string) error
	// UserTokenChanged says the user has a new API token: the old one
	// opens nothing from now on, and its connections are closed.
	UserTokenChanged(ctx context.Context, userID, token string) error
	BridgeCreated(ctx context.Context, bridgeID, secret string) error
	BridgeDeleted(ctx context.Context, bridgeID string) error
	// BridgeSecretChanged says the bridge has a new secret: the old one
	// opens nothing from now on, and its connections are closed.
	BridgeSecretChanged(ctx context.Context, bridgeID, secret string) error
	Bound(ctx context.Context, userID, deviceID string) error
	Unbound(ctx context.Context, userID, deviceID string) error
	// Assigned says deviceID moved from bridge `from` to bridge `to` (either
	// "" for none): the rights of both follow at once.
	Assigned(ctx context.Context, deviceID, from, to string) error
}

// AccountNames is implemented by the BrokerAccounts of a broker that may
// hold accounts the server did not make (Mosquitto's plugin, where an
// operator makes some by hand: its admin, a monitoring client). A bridge
// logs in under its id: named as such an account, which the server never
// touches, it got a 201 and a secret that opened nothing
// (docs/reliability.md, bug 500).
type AccountNames interface {
	// NameTaken reports whether the broker holds an account of that name
	// the server did not make. An error says the broker could not be
	// asked.
	NameTaken(ctx context.Context, name string) (bool, error)
}

// WillOnDisconnect is implemented by the BrokerAccounts that disconnect a
// bridge for a change of its rights (a device moved) on a broker that
// does not hold its Will itself, as the embedded broker does until the
// bridge is back or the grace is over. It says what the broker does with
// the Will:
//   - true: it publishes it as it closes the connection, as NATS does; the
//     server holds it for the grace (Commander.BridgesDisconnecting).
//     Held on another broker, an "offline" that follows is the bridge's
//     own, and the bridge read online for the grace after it was lost
//     (docs/reliability.md, bug 201).
//   - false: it never publishes it, as Mosquitto's plugin does; the server
//     publishes it for a bridge not back within the grace
//     (Commander.BridgesDisconnectingWithoutWill). Without it, a bridge
//     lost just then read online for ever (bug 202).
type WillOnDisconnect interface {
	DisconnectPublishesWill() bool
}

// Limits are the bounds of CONTRACT §6 the API enforces. A zero field means
// its default; the rate fields and the per-user bounds of streams and waits
// take a negative value to mean "no limit".
type Limits struct {
	MaxTextBytes     int   // text of a push, bytes of UTF-8; 4096
	MaxTitleBytes    int   // title of a text push; 128
	MaxImageBytes    int64 // an image, decoded; 2 MiB
	MaxImageSide     int   // an image's width and height, pixels; 4096
	MaxAppBytes      int64 // an app package; 16 MiB
	MaxFirmwareBytes int64 // a firmware image; 64 MiB
	// MaxOpenCommands is the number of unfinished commands a device may
	// have; 1000. The broker enforces it (Submit's companion.ErrQueueFull); it
	// is here so that one Limits value describes the service.
	MaxOpenCommands int
	MaxWait         time.Duration // longest Prefer: wait; 60s
	DefaultTTL      time.Duration // of a command; 24h
	MinTTL          time.Duration // 60s
	MaxTTL          time.Duration // 7 days
	MaxJSONBody     int64         // a JSON body other than an image push; 64 KiB
	// BodyIdle is the longest a request body may go without a byte; 60s.
	// A read of the body that waits longer fails, and the request is
	// answered 408 body_timeout (see bodyIdle). It bounds pauses, not
	// the body's time in all: a large upload over a slow link is fine.
	// 60 s, nginx's default client_body_timeout, leaves room for TCP's
	// retransmission backoff after a link has dropped out for a while.
	// A blob download's client, and any large answer's, may likewise take
	// nothing of the answer for at most BodyIdle (blobWriter, Server.data).
	BodyIdle time.Duration
	// BodyMinRate is the least a request body must average, in bytes a
	// second, once its client has kept the server waiting BodyIdle in all;
	// 256 (2 kbit/s, below any real link: ASP.NET Core's Kestrel asks 240,
	// Apache's mod_reqtimeout 500). Without it a client that sends a
	// byte just before each BodyIdle runs out holds a handler for as long
	// as the body limit lets it go on. Only the time the server spends
	// waiting for the body counts, as for BodyIdle, so a body takes at most
	// BodyIdle plus its size at this rate of the client's time. Negative:
	// no minimum.
	BodyMinRate int64

	RequestsPerSecond float64 // per token; 50
	RequestBurst      int     // per token; 100
	RegisterPerMinute int     // register attempts per user; 10
	// UnauthPerMinute is how many requests without a valid token one
	// source address may make a minute (the bucket holds as many); 600.
	UnauthPerMinute int
	// QueueFullRetryAfter is the Retry-After of a 429 queue_full; 5s.
	QueueFullRetryAfter time.Duration
	// MaxStreamsPerUser is how many event streams (GET /api/v1/events)
	// one user may have open at once on this server; 32: a person's
	// browsers, phones and tools, and room for streams the client has lost
	// but the server has not yet seen go (a phone that changed networks).
	// Past it a stream is a 429 too_many_streams. Negative: no limit.
	MaxStreamsPerUser int
	// MaxWaitsPerUser is how many requests of one user Prefer: wait may
	// hold at once on this server; 100, the per-token burst (and GitHub's
	// bound on a user's concurrent requests). Past it such a request is a
	// 429 too_many_waits before it does anything. Negative: no limit.
	MaxWaitsPerUser int
	// MaxBridgesPerUser is how many bridges of their own one user may
	// have (POST /api/v1/bridges); 100: a person's phones and hubs, many
	// times over. Past it a creation is a 422 naming bridge_id. The
	// operator's bridges are not bounded. Negative: no limit.
	MaxBridgesPerUser int
	// MaxBodyBytesPerUser bounds the bytes of request bodies one user's
	// requests may be sending to this server at once, counted by their
	// Content-Length (a chunked body by its route's limit); 64 MiB: a
	// dozen of the largest image pushes. Past it a request is a 429
	// rate_limited before its body is read; a body alone always fits.
	// Negative: no limit.
	MaxBodyBytesPerUser int64
}

// DefaultLimits are the limits of CONTRACT §6.
var DefaultLimits = Limits{
	MaxTextBytes:        4096,
	MaxTitleBytes:       128,
	MaxImageBytes:       2 << 20,
	MaxImageSide:        4096,
	MaxAppBytes:         16 << 20,
	MaxFirmwareBytes:    64 << 20,
	MaxOpenCommands:     1000,
	MaxWait:             60 * time.Second,
	DefaultTTL:          86400 * time.Second,
	MinTTL:              60 * time.Second,
	MaxTTL:              604800 * time.Second,
	MaxJSONBody:         64 << 10,
	BodyIdle:            60 * time.Second,
	BodyMinRate:         256,
	RequestsPerSecond:   50,
	RequestBurst:        100,
	RegisterPerMinute:   10,
	UnauthPerMinute:     600,
	QueueFullRetryAfter: 5 * time.Second,
	MaxStreamsPerUser:   32,
	MaxWaitsPerUser:     100,
	MaxBridgesPerUser:   100,
	MaxBodyBytesPerUser: 64 << 20,
}

func (l Limits) withDefaults() Limits {
	d := DefaultLimits
	set := func(v *int, def int) {
		if *v == 0 {
			*v = def
		}
	}
	set64 := func(v *int64, def int64) {
		if *v == 0 {
			*v = def
		}
	}
	setDur := func(v *time.Duration, def time.Duration) {
		if *v == 0 {
			*v = def
		}
	}
	set(&l.MaxTextBytes, d.MaxTextBytes)
	set(&l.MaxTitleBytes, d.MaxTitleBytes)
	set64(&l.MaxImageBytes, d.MaxImageBytes)
	set(&l.MaxImageSide, d.MaxImageSide)
	set64(&l.MaxAppBytes, d.MaxAppBytes)
	set64(&l.MaxFirmwareBytes, d.MaxFirmwareBytes)
	set(&l.MaxOpenCommands, d.MaxOpenCommands)
	setDur(&l.MaxWait, d.MaxWait)
	setDur(&l.DefaultTTL, d.DefaultTTL)
	setDur(&l.MinTTL, d.MinTTL)
	setDur(&l.MaxTTL, d.MaxTTL)
	set64(&l.MaxJSONBody, d.MaxJSONBody)
	setDur(&l.BodyIdle, d.BodyIdle)
	set64(&l.BodyMinRate, d.BodyMinRate)
	if l.RequestsPerSecond == 0 {
		l.RequestsPerSecond = d.RequestsPerSecond
	}
	set(&l.RequestBurst, d.RequestBurst)
	set(&l.RegisterPerMinute, d.RegisterPerMinute)
	set(&l.UnauthPerMinute, d.UnauthPerMinute)
	setDur(&l.QueueFullRetryAfter, d.QueueFullRetryAfter)
	set(&l.MaxStreamsPerUser, d.MaxStreamsPerUser)
	set(&l.MaxWaitsPerUser, d.MaxWaitsPerUser)
	set(&l.MaxBridgesPerUser, d.MaxBridgesPerUser)
	set64(&l.MaxBodyBytesPerUser, d.MaxBodyBytesPerUser)
	return l
}

// MaxByteLimit is the largest byte limit of a Limits (1 TiB). The body
// limits worked out from them (six bytes to a text's byte escaped, an
// image's base64, a byte past the limit) stay well within an int64; near
// its end they wrapped, and a text past 64 KiB, or every image, was refused.
const MaxByteLimit int64 = 1 << 40

func (l Limits) check() error {
	switch {
	case l.MaxTextBytes < 0, l.MaxTitleBytes < 0, l.MaxImageBytes < 0, l.MaxImageSide < 0,
		l.MaxAppBytes < 0, l.MaxFirmwareBytes < 0, l.MaxOpenCommands < 0, l.MaxWait < 0,
		l.MaxJSONBody < 0, l.BodyIdle < 0, l.QueueFullRetryAfter < 0:
		return errors.New("api: negative limit")
	case int64(l.MaxTextBytes) > MaxByteLimit, int64(l.MaxTitleBytes) > MaxByteLimit, l.MaxImageBytes > MaxByteLimit,
		l.MaxAppBytes > MaxByteLimit, l.MaxFirmwareBytes > MaxByteLimit, l.MaxJSONBody > MaxByteLimit:
		return fmt.Errorf("api: a byte limit over %d (1 TiB)", MaxByteLimit)
	case l.MinTTL < time.Second || l.MinTTL > l.DefaultTTL || l.DefaultTTL > l.MaxTTL:
		return fmt.Errorf("api: TTLs must satisfy 1s <= MinTTL (%v) <= DefaultTTL (%v) <= MaxTTL (%v)", l.MinTTL, l.DefaultTTL, l.MaxTTL)
	case l.MaxTTL%time.Second != 0 || l.MinTTL%time.Second != 0 || l.DefaultTTL%time.Second != 0:
		return errors.New("api: TTLs must be whole seconds")
	}
	return nil
}

// imageBody is the body limit of an image push: the base64 of the largest
// image (padded: four bytes to every three begun), each of its bytes room
// for two, plus the room of an ordinary JSON body, in int64 on every
// platform (an int of 32 bits would wrap at 2 GiB). Two, since a "/" of
// base64 may come escaped as "\/": Android's org.json and PHP's
// json_encode write it so, and an image's base64 may be nearly all "/"
// (0xff bytes, as in an uncompressed white PNG). With one, such an image
// under its limit was a 413 (docs/reliability.md, bug 261).
func (l Limits) imageBody() int64 {
	return 2*((l.MaxImageBytes+2)/3*4) + l.MaxJSONBody
}

// textBody is the body limit of a text push: an ordinary JSON body's, or
// more when the longest text and title the limits allow need it, each byte
// escaped at its longest ("<" is \u003c, six bytes), with 4 KiB for the
// rest. (With only MaxJSONBody, a MaxTextBytes past it took texts that the
// body limit refused with a 413.)
func (l Limits) textBody() int64 {
	return max(l.MaxJSONBody, 6*(int64(l.MaxTextBytes)+int64(l.MaxTitleBytes))+4<<10)
}

// Options configure New. The zero value of each optional field means its
// default.
type Options struct {
	Store    Store     // required
	Commands Commander // required
	// AdminToken is the bearer of the admin API and may also fetch blobs.
	// When empty the admin API refuses every request.
	AdminToken string
	// Tokens, when set, admits access tokens of an identity provider
	// (OIDCVerifier) besides the API's own tokens; their sub names the user.
	Tokens TokenVerifier
	// BrokerAccounts, when set, keeps an external MQTT broker's accounts.
	BrokerAccounts BrokerAccounts
	// ServerMQTTUsername is the server's own account on an external MQTT
	// broker: no bridge may be named so (a bridge logs in under its id).
	ServerMQTTUsername string
	Limits             Limits
	// Ready says whether the service can take requests (store reachable,
	// MQTT connected), for /readyz: nil when it can, else what it lacks,
	// in words for an operator (the 503's detail: never a Go error's
	// text). nil means always ready.
	Ready func(context.Context) error
	// Unavailable tells the errors of a store that cannot be reached now
	// (PostgreSQL restarting): they are answered 503 unavailable with
	// Retry-After, not 500. nil: none is.
	Unavailable func(error) bool
	// Events is the hub of GET /api/v1/events (see NewEvents); nil: the
	// route answers 404.
	Events *Events
	// RateLimiter keeps the buckets of the rate limits of Limits; nil
	// keeps them in this process. Replicas behind one balancer share one
	// (postgres.Store.RateLimiter), or a client gets each one's allowance.
	RateLimiter RateLimiter
	// Requests, when set, is told of every answered request, for the
	// server's metrics.
	Requests RequestObserver
	Logger   *slog.Logger     // slog.Default() when nil
	Now      func() time.Time // time.Now when nil
}

// Server is the HTTP API. Create it with New; serve Handler.
type Server struct {
	store      Store
	cmds       Commander
	adminHash  []byte // SHA-256 of the admin token; nil when there is none
	tokens     TokenVerifier
	accounts   BrokerAccounts // nil: nothing to tell
	serverMQTT string         // the server's account on the MQTT broker; "" none
	limits     Limits
	// bodyTimeouts are the details of bodyIdle's 408s.
	bodyTimeouts bodyTimeouts
	ready        func(context.Context) error
	// unavailable tells the store's errors of being unreachable.
	unavailable func(error) bool
	events      *Events // the hub of GET /events; nil: none
	log         *slog.Logger
	// notJudged logs the access tokens not judged (a 503) once a minute a
	// reason, with a count: one a request was a line for every request of
	// every user while the identity provider was away, and for every
	// forged token of a made-up key id (docs/reliability.md, bug 490).
	notJudged *logevery.Log
	// refused logs the access tokens refused (a 401) once a minute a
	// kind of reason at Info, each at Debug (docs/reliability.md, bug
	// 493).
	refused    *logevery.Log
	now        func() time.Time
	requests   RequestObserver // nil: nobody counts requests
	held       holds           // event streams and Prefer: wait requests, per user
	bodies     bodyBudgets     // the bytes of bodies being sent, per user
	reads      bodyReads       // the bodies being read, for a shutdown to end
	openapiDoc []byte          // GET /api/v1/openapi.json: the document with these limits
	ids        *requestIDs     // the ids of requests that bring none

	limiter  RateLimiter // the buckets of the three limits below
	rate     limitSpec   // requests per token
	register limitSpec   // register attempts per user
	unauth   limitSpec   // requests without a valid token, per source address

	engine *gin.Engine
}

var ginMode sync.Once

// New checks the options and builds the server and its routes.
func New(opts Options) (*Server, error) {
	if opts.Store == nil {
		return nil, errors.New("api: no store")
	}
	if opts.Commands == nil {
		return nil, errors.New("api: no command broker")
	}
	limits := opts.Limits.withDefaults()
	if err := limits.check(); err != nil {
		return nil, err
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Ready == nil {
		opts.Ready = func(context.Context) error { return nil }
	}
	if opts.Unavailable == nil {
		opts.Unavailable = func(error) bool { return false }
	}
	s := &Server{
		store:       opts.Store,
		cmds:        opts.Commands,
		serverMQTT:  opts.ServerMQTTUsername,
		tokens:      opts.Tokens,
		accounts:    opts.BrokerAccounts,
		limits:      limits,
		ready:       opts.Ready,
		unavailable: opts.Unavailable,
		events:      opts.Events,
		requests:    opts.Requests,
		log:         opts.Logger.With("component", "api"),
		now:         opts.Now,
		ids:         newRequestIDs(),
	}
	doc, err := openapiFor(limits)
	if err != nil {
		return nil, err
	}
	s.openapiDoc = doc
	s.notJudged = logevery.New(s.log, time.Minute, s.now)
	s.refused = logevery.New(s.log, time.Minute, s.now)
	s.bodies.max = limits.MaxBodyBytesPerUser
	s.bodyTimeouts = newBodyTimeouts(limits)
	if opts.AdminToken != "" {
		s.adminHash = companion.HashSecret(opts.AdminToken)
	}
	s.limiter = opts.RateLimiter
	if s.limiter == nil {
		s.limiter = newLocalLimiter(s.now)
	}
	s.rate = newLimit("request:", limits.RequestsPerSecond, limits.RequestBurst)
	s.register = newLimit("register:", float64(limits.RegisterPerMinute)/60, limits.RegisterPerMinute)
	s.unauth = newLimit("unauth:", float64(limits.UnauthPerMinute)/60, limits.UnauthPerMinute)
	ginMode.Do(func() { gin.SetMode(gin.ReleaseMode) })
	s.engine = s.routes()
	return s, nil
}

// Handler returns the HTTP handler of every route.
func (s *Server) Handler() http.Handler { return s.engine }

// handler is a gin handler that returns its failure; h turns the failure
// into a problem+json answer.
type handler func(c *gin.Context) error

func (s *Server) h(f handler) gin.HandlerFunc {
	return func(c *gin.Context) {
		if err := f(c); err != nil {
			s.fail(c, err)
		}
	}
}

func (s *Server) routes() *gin.Engine {
	e := gin.New()
	// The source address is the TCP peer: no X-Forwarded-For is trusted,
	// or a client could pick the address its failures are counted under.
	e.SetTrustedProxies(nil)
	e.HandleMethodNotAllowed = true
	// A path with a trailing slash names nothing: gin's default answers it
	// with a redirect in plain HTML, which is no problem+json and which a
	// client of a POST follows or drops; it is the 404 of any unknown path.
	e.RedirectTrailingSlash = false
	e.Use(s.requestID)
	if s.requests != nil {
		e.Use(s.observeRequest)
	}
	e.Use(s.recoverer, s.logRequest, s.bodyIdle)
	e.NoRoute(s.h(func(*gin.Context) error { return errNotFound }))
	e.NoMethod(s.h(func(*gin.Context) error { return &Error{Code: CodeMethodNotAllowed} }))

	// Every GET route serves HEAD too (RFC 9110 §9.3.2: the status and
	// headers of GET, without the body, which net/http leaves out); load
	// balancers and uptime checkers probe with it, and clients ask a
	// download's size so.
	get := func(g gin.IRoutes, path string, handlers ...gin.HandlerFunc) {
		g.GET(path, handlers...)
		g.HEAD(path, handlers...)
	}
	get(e, "/healthz", s.healthz)
	get(e, "/readyz", s.h(s.readyz))

	v1 := e.Group("/api/v1")
	get(v1, "/openapi.json", s.openapi)

	user := v1.Group("", s.sourceLimit, s.userAuth, s.rateLimit, s.bodyBudget)
	user.POST("/devices/register", s.h(s.registerDevice))
	get(user, "/devices", s.h(s.listDevices))
	get(user, "/devices/:id", s.h(s.getDevice))
	user.DELETE("/devices/:id", s.h(s.unbindDevice))
	get(user, "/devices/:id/status", s.h(s.deviceStatus))
	// The routes a Prefer: wait may hold (waitSlot bounds them per user);
	// a cancel answers at once.
	user.POST("/devices/:id/push/text", s.waitSlot, s.h(s.pushText))
	user.POST("/devices/:id/push/image", s.waitSlot, s.h(s.pushImage))
	get(user, "/devices/:id/apps", s.h(s.deviceApps))
	user.POST("/devices/:id/apps/install", s.waitSlot, s.h(s.installApp))
	user.DELETE("/devices/:id/apps/:app_id", s.waitSlot, s.h(s.uninstallApp))
	user.PUT("/devices/:id/apps/:app_id/update", s.waitSlot, s.h(s.updateApp))
	get(user, "/devices/:id/settings", s.h(s.getSettings))
	user.PUT("/devices/:id/settings", s.waitSlot, s.h(s.putSettings))
	get(user, "/devices/:id/ota/check", s.h(s.otaCheck))
	user.POST("/devices/:id/ota/update", s.waitSlot, s.h(s.otaUpdate))
	get(user, "/devices/:id/commands", s.h(s.listCommands))
	get(user, "/devices/:id/commands/:command_id", s.waitSlot, s.h(s.getCommand))
	user.DELETE("/devices/:id/commands/:command_id", s.h(s.cancelCommand))
	user.PUT("/devices/:id/bridge", s.h(s.assignUserDevice))
	user.POST("/bridges", s.h(s.createUserBridge))
	get(user, "/bridges", s.h(s.listUserBridges))
	user.DELETE("/bridges/:bridge_id", s.h(s.deleteUserBridge))
	user.POST("/bridges/:bridge_id/secret", s.h(s.newUserBridgeSecret))
	get(user, "/apps", s.h(s.appCatalog))
	get(user, "/events", s.h(s.streamEvents))

	admin := v1.Group("/admin", s.sourceLimit, s.adminAuth, s.rateLimit)
	admin.POST("/users", s.h(s.adminCreateUser))
	admin.POST("/users/:user_id/token", s.h(s.adminNewUserToken))
	admin.POST("/devices", s.h(s.adminProvisionDevice))
	admin.PUT("/devices/:device_id/bridge", s.h(s.adminAssignDevice))
	admin.POST("/bridges", s.h(s.adminCreateBridge))
	admin.POST("/bridges/:bridge_id/secret", s.h(s.adminNewBridgeSecret))
	admin.PUT("/firmware/:model/:version", s.h(s.adminPutFirmware))
	admin.PUT("/apps/:app_id/:version", s.h(s.adminPutApp))
	get(admin, "/backup", s.h(s.adminBackup))

	get(v1, "/blobs/:sha256", s.sourceLimit, s.blobAuth, s.rateLimit, s.h(s.getBlob))
	return e
}

func (s *Server) healthz(c *gin.Context) {
	c.JSON(http.StatusOK, gin.H{"status": "ok"})
}

func (s *Server) readyz(c *gin.Context) error {
	if err := s.ready(c.Request.Context()); err != nil {
		return &Error{Code: CodeNotReady, Detail: err.Error()}
	}
	c.JSON(http.StatusOK, gin.H{"status": "ready"})
	return nil
}

// recoverer is the last line: a handler that panics is logged with its
// stack and answered with a 500 that says nothing more. Like any failure
// (see fail) it gives up the request's claim on its Idempotency-Key, which
// would otherwise hold the key, and answer its repeats 409, for a minute.
//
// A fault of the memory the handler reads is such a panic too, not the
// end of the process: bbolt reads the store's file through its mapping,
// where a page the disk cannot read (or the file cut short) is a SIGBUS,
// which Go turns into a panic only on a goroutine that asked for it
// (debug.SetPanicOnFault, restored as the request ends). So a failing
// disk fails the requests that read what it lost, and the server goes
// on (bug 344).
func (s *Server) recoverer(c *gin.Context) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		v := recover()
		if v == nil {
			return
		}
		if v == http.ErrAbortHandler {
			panic(v)
		}
		s.log.ErrorContext(c.Request.Context(), "handler panicked", requestIDAttr(c),
			"method", c.Request.Method, "path", c.Request.URL.Path, "panic", fmt.Sprint(v), "stack", string(stack()))
		s.releaseIdempotent(c)
		if !c.Writer.Written() {
			s.writeProblem(c, &Error{Code: CodeInternal})
		}
		c.Abort()
	}()
	c.Next()
}

func (s *Server) logRequest(c *gin.Context) {
	ctx := c.Request.Context()
	if !s.log.Enabled(ctx, slog.LevelDebug) {
		c.Next() // no arguments to build for a line nobody reads
		return
	}
	start := time.Now()
	c.Next()
	s.log.DebugContext(ctx, "request", requestIDAttr(c),
		"method", c.Request.Method, "route", c.FullPath(), "status", c.Writer.Status(), "duration", time.Since(start))
}
