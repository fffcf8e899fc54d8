package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/gin-gonic/gin"

	"github.com/devicecompanion/companion/topics"
)

// Bridges serve the devices assigned to them (CONTRACT §9). The operator's
// bridges are made through the admin API; a user may run bridges of their
// own (a phone, a home hub), which serve only that user's devices.

type createBridgeRequest struct {
	BridgeID string `json:"bridge_id"`
}

type bridgeJSON struct {
	BridgeID string `json:"bridge_id"`
	Secret   string `json:"secret,omitempty"`
}

type assignRequest struct {
	BridgeID *string `json:"bridge_id"` // null: no bridge
}

// idempotencyScope is whose Idempotency-Key records a request of ownerID
// ("" the operator) claims: the user's, or the admin's.
func idempotencyScope(ownerID string) string {
	if ownerID == "" {
		return adminUserID
	}
	return ownerID
}

func (s *Server) adminCreateBridge(c *gin.Context) error { return s.createBridge(c, "") }

func (s *Server) createUserBridge(c *gin.Context) error {
	return s.createBridge(c, currentUser(c).ID)
}

// createBridge makes a bridge of ownerID ("" the operator's) and answers
// its secret, which exists only in this answer.
func (s *Server) createBridge(c *gin.Context, ownerID string) error {
	var req createBridgeRequest
	body, err := readJSON(c, s.limits.MaxJSONBody, false, &req)
	if err != nil {
		return err
	}
	principal := idempotencyScope(ownerID)
	rec, replayed, err := s.beginIdempotent(c, principal, body.raw)
	if err != nil || replayed {
		return err
	}
	fields := body.fieldErrors()
	if !topics.ValidBridgeID(req.BridgeID) {
		fields = append(fields, FieldError{Field: "bridge_id", Message: "must be 1 to 64 of A-Z a-z 0-9 . _ : -"})
	}
	if err := validationError(fields); err != nil {
		return err
	}
	if s.serverMQTT != "" && req.BridgeID == s.serverMQTT {
		// A bridge logs in to the broker under its id: named so, it got no
		// account on Mosquitto (the server's own), a secret that opened
		// nothing. (The store refuses a user's id likewise.)
		return &Error{Code: CodeBridgeExists, Detail: "the name of the server's own account on the MQTT broker: a bridge logs in under its id"}
	}
	ctx := c.Request.Context()
	if n := s.limits.MaxBridgesPerUser; ownerID != "" && n > 0 {
		// Each bridge is a record and, on Mosquitto, a client and a role
		// of the plugin, which writes its whole configuration again on
		// every change: unbounded, one user's token made them at the
		// request rate. Counted before the creation, so that requests at
		// once may pass the bound by as many as they are. Counted
		// without the devices the bridges serve: a page of ListBridges
		// read them all, each creation O(the user's devices) (bug 367).
		have, err := s.store.CountBridges(ctx, ownerID)
		if err != nil {
			return err
		}
		if have >= n {
			return validationError([]FieldError{{Field: "bridge_id", Message: fmt.Sprintf(
				"this account has %d bridges, as many as it may: delete one first", have)}})
		}
	}
	if err := s.accountsRefused(); err != nil {
		return err
	}
	if err := s.bridgeNameTaken(ctx, req.BridgeID); err != nil {
		return err
	}
	secret, hash, err := newSecret(bridgeSecretPrefix)
	if err != nil {
		return err
	}
	// Not the request's context: a bridge on disk whose creation read as
	// the client's hang-up never got its broker account, and its repeat is
	// a 409 (docs/reliability.md, bug 280).
	ctx = context.WithoutCancel(ctx)
	// A repeat gets the answer without the secret: it is stored nowhere.
	actx, err := withAnswer(ctx, rec, http.StatusCreated, bridgeJSON{BridgeID: req.BridgeID}, "")
	if err != nil {
		return err
	}
	err = s.store.CreateBridge(actx, companion.Bridge{ID: req.BridgeID, SecretHash: hash, CreatedAt: s.now(), OwnerID: ownerID})
	switch {
	case errors.Is(err, companion.ErrExists):
		return &Error{Code: CodeBridgeExists}
	case err != nil:
		return err
	}
	rec = settled(c)
	if s.accounts != nil {
		_ = s.accounts.BridgeCreated(ctx, req.BridgeID, secret) // logged and retried there
	}
	return s.reply(c, http.StatusCreated, bridgeJSON{BridgeID: req.BridgeID, Secret: secret}, "", rec, nil)
}

// AccountsNotReady is implemented by the BrokerAccounts that can know
// they cannot make or change any account now: the dynamic-security
// driver, while Mosquitto refuses the server the plugin (its account is
// not the plugin's admin). NotReady says why, nil otherwise.
type AccountsNotReady interface {
	NotReady() error
}

// accountsRefused answers 503 unavailable, before anything is stored,
// while the broker's accounts cannot be written at all. A bridge made
// then was answered 201 with a secret Mosquitto never had: its account's
// creation, kept in the server's memory only, waited for the operator to
// make the server the plugin's admin, and was lost with a restart meant
// to mend it, the secret opening nothing for good and the caller told
// nothing; a new secret or token (the remedy for one that leaked) left
// the old one working on Mosquitto while the answer said it opened
// nothing (docs/reliability.md, bug 488). A failure of one change
// (Mosquitto away for a moment) is still the driver's to retry, and
// answered as done.
func (s *Server) accountsRefused() error {
	nr, ok := s.accounts.(AccountsNotReady)
	if !ok {
		return nil
	}
	if err := nr.NotReady(); err != nil {
		return &Error{Code: CodeUnavailable, RetryAfter: 30,
			Detail: "nothing was stored: the server cannot write this account on the MQTT broker: " + err.Error()}
	}
	return nil
}

// bridgeNameTaken refuses, 409, a bridge id the MQTT broker holds as an
// account the server did not make (AccountNames). A broker that cannot be
// asked now refuses nothing: the creation goes on as before, its account
// written (or found not the server's, and logged) by the BrokerAccounts.
func (s *Server) bridgeNameTaken(ctx context.Context, bridgeID string) error {
	an, ok := s.accounts.(AccountNames)
	if !ok {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	taken, err := an.NameTaken(ctx, bridgeID)
	if err != nil {
		s.log.Warn("could not ask the MQTT broker whether a new bridge's id is an account of its own; creating the bridge", "bridge_id", bridgeID, "err", err)
		return nil
	}
	if taken {
		return &Error{Code: CodeBridgeExists, Detail: "the name of an account on the MQTT broker that the server did not make (an operator's): a bridge logs in under its id; choose another"}
	}
	return nil
}

type userBridgeJSON struct {
	BridgeID  string   `json:"bridge_id"`
	Devices   []string `json:"devices"`
	CreatedAt apiTime  `json:"created_at"`
}

// listUserBridges answers the caller's own bridges, with the devices each
// serves, in full pages: each page read at one instant, so that a device
// moved meanwhile shows on one bridge of it, never on none or two.
func (s *Server) listUserBridges(c *gin.Context) error {
	user := currentUser(c)
	limit, after, err := page(c, topics.ValidBridgeID, nil)
	if err != nil {
		return err
	}
	bs, more, err := s.store.ListBridges(c.Request.Context(), user.ID, after, limit)
	if err != nil {
		return err
	}
	out := make([]userBridgeJSON, 0, len(bs))
	for _, b := range bs {
		out = append(out, userBridgeJSON{BridgeID: b.ID, Devices: b.Devices, CreatedAt: timeOrNull(b.CreatedAt)})
	}
	var next *string
	if more && len(bs) > 0 {
		next = cursorOf(bs[len(bs)-1].ID)
	}
	return s.reply(c, http.StatusOK, gin.H{"bridges": out, "next_cursor": next}, "", nil, nil)
}

// deleteUserBridge removes one of the caller's own bridges: its devices
// are served by no bridge from then on, and its secret stops working.
func (s *Server) deleteUserBridge(c *gin.Context) error {
	user := currentUser(c)
	rec, replayed, err := s.beginIdempotent(c, user.ID, nil)
	if err != nil || replayed {
		return err
	}
	id := c.Param("bridge_id")
	if !topics.ValidBridgeID(id) {
		return &Error{Code: CodeBridgeNotFound}
	}
	ctx := context.WithoutCancel(c.Request.Context()) // what the deletion moves must follow it (bug 277)
	actx, err := withAnswer(ctx, rec, http.StatusNoContent, nil, "")
	if err != nil {
		return err
	}
	// The word of the bridge on the commands on their way to it comes in
	// before its devices lose it, while the broker still takes it: what it
	// had must not go to their next bridge (bug 553, as bug 509 for a move).
	release := func() {}
	if b, err := s.store.Bridge(ctx, id); err == nil && b.OwnerID == user.ID {
		if devs, err := s.store.ServedDevices(ctx, id); err == nil && len(devs) > 0 {
			release = s.cmds.PrepareMove(devs...)
		}
	}
	served, err := s.store.DeleteBridge(actx, id, user.ID)
	release()
	switch {
	case errors.Is(err, companion.ErrNotFound):
		return &Error{Code: CodeBridgeNotFound}
	case err != nil:
		return err
	}
	rec = settled(c)
	for _, dev := range served {
		s.moved(ctx, dev, id, "")
	}
	if s.accounts != nil {
		_ = s.accounts.BridgeDeleted(ctx, id) // logged and retried there
	}
	// Else it read away for good, once its Will was taken in (bug 315).
	s.cmds.BridgeDeleted(id)
	return s.reply(c, http.StatusNoContent, nil, "", rec, nil)
}

func (s *Server) adminNewBridgeSecret(c *gin.Context) error { return s.newBridgeSecret(c, "") }

func (s *Server) newUserBridgeSecret(c *gin.Context) error {
	return s.newBridgeSecret(c, currentUser(c).ID)
}

// newBridgeSecret gives a bridge of ownerID ("" the operator, who may
// change any bridge's) a new secret and answers it, as creation does: it
// exists only in this answer. From the store's commit on, the old secret
// opens nothing, on the broker or for blob downloads, and the bridge's
// connections are closed; the bridge keeps its id, its devices, its
// session and its spool, and logs in again once given the new secret. It
// is also what repairs a bridge whose account on Mosquitto was lost
// (docs/mosquitto.md).
func (s *Server) newBridgeSecret(c *gin.Context, ownerID string) error {
	principal := idempotencyScope(ownerID)
	rec, replayed, err := s.beginIdempotent(c, principal, nil)
	if err != nil || replayed {
		return err
	}
	notFound := &Error{Code: CodeBridgeNotFound}
	if ownerID == "" {
		notFound = errAdminBridgeNotFnd
	}
	id := c.Param("bridge_id")
	if !topics.ValidBridgeID(id) {
		return notFound
	}
	if err := s.accountsRefused(); err != nil {
		return err
	}
	secret, hash, err := newSecret(bridgeSecretPrefix)
	if err != nil {
		return err
	}
	// Not the request's context: a secret on disk whose broker account
	// was not told kept the old one working there (bug 277's reason).
	ctx := context.WithoutCancel(c.Request.Context())
	// A repeat gets the answer without the secret: it is stored nowhere.
	actx, err := withAnswer(ctx, rec, http.StatusOK, bridgeJSON{BridgeID: id}, "")
	if err != nil {
		return err
	}
	switch err := s.store.SetBridgeSecret(actx, id, ownerID, hash); {
	case errors.Is(err, companion.ErrNotFound): // also another user's
		return notFound
	case err != nil:
		return err
	}
	rec = settled(c)
	if s.accounts != nil {
		// Its connections are closed: on Mosquitto without its Will,
		// which the server then publishes for a bridge not back within
		// the grace. Without it, a bridge whose edge box still had the old
		// secret read online, with its devices, for good (bug 299).
		s.bridgesDisconnecting(id)
		_ = s.accounts.BridgeSecretChanged(ctx, id, secret) // logged and retried there
	}
	return s.reply(c, http.StatusOK, bridgeJSON{BridgeID: id, Secret: secret}, "", rec, nil)
}

// assignUserDevice assigns one of the caller's devices to one of the
// caller's bridges (or, with null, to none).
func (s *Server) assignUserDevice(c *gin.Context) error {
	user := currentUser(c)
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	return s.assign(c, b.DeviceID, user.ID)
}

// adminAssignDevice assigns any device to a bridge, or to none.
func (s *Server) adminAssignDevice(c *gin.Context) error {
	id := c.Param("device_id")
	if !topics.ValidDeviceID(id) {
		return errAdminDeviceNotFnd
	}
	return s.assign(c, id, "")
}

func (s *Server) assign(c *gin.Context, deviceID, ownerID string) error {
	var req assignRequest
	body, err := readJSON(c, s.limits.MaxJSONBody, false, &req)
	if err != nil {
		return err
	}
	principal := idempotencyScope(ownerID)
	rec, replayed, err := s.beginIdempotent(c, principal, body.raw)
	if err != nil || replayed {
		return err
	}
	fields := body.fieldErrors()
	bridge := ""
	if _, ok := body.members["bridge_id"]; !ok {
		// Only an explicit null unassigns: a misspelt member must not.
		fields = append(fields, FieldError{Field: "bridge_id", Message: "is required: a bridge id, or null for no bridge"})
	}
	if req.BridgeID != nil {
		bridge = *req.BridgeID
		if !topics.ValidBridgeID(bridge) {
			fields = append(fields, FieldError{Field: "bridge_id", Message: "must be 1 to 64 of A-Z a-z 0-9 . _ : -, or null"})
		}
	}
	if err := validationError(fields); err != nil {
		return err
	}
	ctx := context.WithoutCancel(c.Request.Context()) // what the move changes must follow it (bug 277)
	out := gin.H{"device_id": deviceID, "bridge_id": stringOrNull(bridge)}
	actx, err := withAnswer(ctx, rec, http.StatusOK, out, "")
	if err != nil {
		return err
	}
	// The word of the device's bridge on the commands on their way to it
	// comes in before the move, while the broker still takes it (bug 509).
	release := s.cmds.PrepareMove(deviceID)
	previous, err := s.store.AssignDevice(actx, deviceID, bridge, ownerID)
	release()
	deviceNotFound, bridgeNotFound := errDeviceNotFound, &Error{Code: CodeBridgeNotFound}
	if ownerID == "" {
		deviceNotFound, bridgeNotFound = errAdminDeviceNotFnd, errAdminBridgeNotFnd
	}
	switch {
	case errors.Is(err, companion.ErrNotOwned) && ownerID == "" && bridge != "":
		// The operator names any device, and any bridge: only a user's
		// bridge refuses a device not bound to that user.
		return errAdminUsersBridge
	case errors.Is(err, companion.ErrNotFound) && bridge != "":
		// A bridge that is not the caller's reads as none at all.
		if _, derr := s.store.RegistryDevice(ctx, deviceID); errors.Is(derr, companion.ErrNotFound) {
			return deviceNotFound
		}
		return bridgeNotFound
	case errors.Is(err, companion.ErrNotFound):
		return deviceNotFound
	case err != nil:
		return err
	}
	rec = settled(c)
	if previous != bridge {
		s.moved(ctx, deviceID, previous, bridge)
	}
	return s.reply(c, http.StatusOK, out, "", rec, nil)
}

// moved tells the broker and the broker's accounts that a device changed
// bridges: its unfinished commands go to the new one, and the rights on the
// broker follow (the bridges are disconnected, and connect again).
func (s *Server) moved(ctx context.Context, deviceID, from, to string) {
	s.cmds.DeviceMoved(deviceID)
	if s.accounts == nil {
		return
	}
	s.bridgesDisconnecting(from, to)
	_ = s.accounts.Assigned(ctx, deviceID, from, to) // logged and retried there
}

// bridgesDisconnecting tells the broker that the broker's accounts are
// about to close the bridges' connections, so that a bridge's Will stands
// as the broker leaves it (WillOnDisconnect): held for the grace where the
// broker publishes it, published for a bridge not back by then where it
// does not. Call it with s.accounts set.
func (s *Server) bridgesDisconnecting(bridgeIDs ...string) {
	switch w, ok := s.accounts.(WillOnDisconnect); {
	case !ok: // the embedded broker holds the bridges' Wills itself
	case w.DisconnectPublishesWill():
		s.cmds.BridgesDisconnecting(bridgeIDs...)
	default:
		s.cmds.BridgesDisconnectingWithoutWill(bridgeIDs...)
	}
}
