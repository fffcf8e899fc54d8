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

const (
	maxNameBytes      = 128
	maxClaimCodeBytes = 256
)

// boundDevice is the device of the path when it is bound to the caller.
// An id that breaks the rules, an unknown device and another user's device
// are the same 404, so that nobody learns which ids exist.
func (s *Server) boundDevice(c *gin.Context) (companion.Binding, error) {
	id := c.Param("id")
	if !topics.ValidDeviceID(id) {
		return companion.Binding{}, errDeviceNotFound
	}
	b, err := s.store.Binding(c.Request.Context(), id)
	switch {
	case errors.Is(err, companion.ErrNotFound):
		return companion.Binding{}, errDeviceNotFound
	case err != nil:
		return companion.Binding{}, err
	case b.UserID != currentUser(c).ID:
		return companion.Binding{}, errDeviceNotFound
	}
	return b, nil
}

func deviceLocation(id string) string { return "/api/v1/devices/" + id }

// checkName checks a display name: 1–128 bytes, no control characters,
// not blank.
func checkName(field, name string) []FieldError {
	switch {
	case name == "":
		return []FieldError{{Field: field, Message: "must not be empty"}}
	case len(name) > maxNameBytes:
		return []FieldError{{Field: field, Message: "must be at most 128 bytes"}}
	}
	// With the character and its byte, as free text's (checkText): the
	// message alone did not show where a pasted tab was (bug 559).
	if errs := checkText(field, name, "", ""); errs != nil {
		return errs
	}
	if topics.Blank(name) {
		return []FieldError{{Field: field, Message: "must not be blank"}}
	}
	return nil
}

// checkText checks free text that a device shows or a person types: no
// control character but those of allowed. A device's firmware holds text
// as a C string (a NUL ends it there, and the rest is lost with the device
// reporting success) and draws it on a display, which has no glyph for the
// others (an ESC, a backspace, a C1 code from text decoded as Latin-1).
func checkText(field, s, allowed, why string) []FieldError {
	r, at := topics.ControlChar(s, allowed)
	if at < 0 {
		return nil
	}
	return []FieldError{{Field: field, Message: fmt.Sprintf("must not contain control characters%s: it has U+%04X at byte %d", why, r, at)}}
}

type registerRequest struct {
	DeviceID  string  `json:"device_id"`
	ClaimCode string  `json:"claim_code"`
	Name      *string `json:"name"`
}

// dummyClaimHash is compared against when the device is unknown, so that
// an unknown device and a wrong code take the same time.
var dummyClaimHash = companion.HashSecret("no such device")

func (s *Server) registerDevice(c *gin.Context) error {
	user := currentUser(c)
	var req registerRequest
	body, err := readJSON(c, s.limits.MaxJSONBody, false, &req)
	if err != nil {
		return err
	}
	rec, replayed, err := s.beginIdempotent(c, user.ID, body.raw)
	if err != nil || replayed {
		return err
	}
	// After the Idempotency-Key: a repeat answered from the key's record
	// (or one that waited for the first request's answer) tries no claim
	// code, and spent the user's attempts, a phone retrying an answer it
	// lost read 429 for the device it had registered (docs/reliability.md,
	// bug 284). A refusal gives the key's claim up, as any failure does.
	if ok, wait, err := s.allow(c, s.register, user.ID); err != nil {
		return err
	} else if !ok {
		return &Error{Code: CodeRateLimited, Detail: "too many register attempts", RetryAfter: ceilSeconds(wait)}
	}
	fields := body.fieldErrors()
	switch {
	case req.DeviceID == "":
		fields = append(fields, FieldError{Field: "device_id", Message: "is required"})
	case !topics.ValidDeviceID(req.DeviceID):
		fields = append(fields, FieldError{Field: "device_id", Message: "must be 1 to 64 of A-Z a-z 0-9 . _ : -"})
	}
	switch {
	case req.ClaimCode == "":
		fields = append(fields, FieldError{Field: "claim_code", Message: "is required"})
	case len(req.ClaimCode) > maxClaimCodeBytes:
		fields = append(fields, FieldError{Field: "claim_code", Message: "must be at most 256 bytes"})
	}
	name := req.DeviceID
	if req.Name != nil {
		fields = append(fields, checkName("name", *req.Name)...)
		name = *req.Name
	}
	if err := validationError(fields); err != nil {
		return err
	}

	ctx := c.Request.Context()
	reg, err := s.store.RegistryDevice(ctx, req.DeviceID)
	want := dummyClaimHash
	switch {
	case err == nil:
		want = reg.ClaimHash
	case !errors.Is(err, companion.ErrNotFound):
		return err
	}
	if !claimMatches(req.ClaimCode, want) || err != nil {
		return errInvalidClaim
	}

	// Not the request's context from here: a client that hangs up as the
	// store commits the binding (PostgreSQL then answers the context's
	// error, though the binding is on disk) left the broker untold, and
	// its repeat, which finds the device bound already, tells it nothing
	// either: the user's MQTT rights lacked the device until a reconcile
	// (docs/reliability.md, bug 280; bug 277 for the unbinding).
	ctx = context.WithoutCancel(ctx)
	// The device's status is read first, for the answer the binding's
	// write records when it binds (withAnswer): a device bound already is
	// answered 200 after, with the binding as it is.
	st, err := s.store.Status(ctx, req.DeviceID)
	if err != nil {
		return err
	}
	binding := companion.Binding{DeviceID: req.DeviceID, UserID: user.ID, Name: name, Model: reg.Model, BoundAt: s.now().UTC().Truncate(time.Microsecond)}
	actx, err := withAnswer(ctx, rec, http.StatusCreated, toDevice(binding, st), deviceLocation(binding.DeviceID))
	if err != nil {
		return err
	}
	b, created, err := s.store.Bind(actx, binding)
	switch {
	case errors.Is(err, companion.ErrBoundToOther):
		return &Error{Code: CodeDeviceAlreadyBound}
	case errors.Is(err, companion.ErrNotFound):
		return errInvalidClaim
	case err != nil:
		return err
	}
	status := http.StatusOK
	if created {
		status, rec = http.StatusCreated, settled(c)
		if s.accounts != nil {
			_ = s.accounts.Bound(ctx, user.ID, b.DeviceID) // logged and retried there
		}
	}
	return s.reply(c, status, toDevice(b, st), deviceLocation(b.DeviceID), rec, nil)
}

func (s *Server) listDevices(c *gin.Context) error {
	user := currentUser(c)
	limit, after, err := page(c, topics.ValidDeviceID, nil)
	if err != nil {
		return err
	}
	ds, err := s.store.ListDevices(c.Request.Context(), user.ID, after, limit+1)
	if err != nil {
		return err
	}
	var next *string
	if len(ds) > limit {
		ds = ds[:limit]
		next = cursorOf(ds[len(ds)-1].Binding.DeviceID)
	}
	devices := make([]deviceJSON, 0, len(ds))
	for _, d := range ds {
		devices = append(devices, toDevice(d.Binding, d.Status))
	}
	return s.reply(c, http.StatusOK, gin.H{"devices": devices, "next_cursor": next}, "", nil, nil)
}

func (s *Server) getDevice(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	st, err := s.store.Status(c.Request.Context(), b.DeviceID)
	if err != nil {
		return err
	}
	return s.reply(c, http.StatusOK, toDevice(b, st), "", nil, nil)
}

func (s *Server) unbindDevice(c *gin.Context) error {
	user := currentUser(c)
	rec, replayed, err := s.beginIdempotent(c, user.ID, nil)
	if err != nil || replayed {
		return err
	}
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	// Not the request's context: a client that hangs up as the store
	// commits (PostgreSQL's answer is then the context's error, though
	// the unbinding is on disk) left the commands it ended in the outbox
	// and on the bridge, where they ran on the device that reads them
	// canceled; and its bridge and broker rights unchanged
	// (docs/reliability.md, bug 277).
	ctx := context.WithoutCancel(c.Request.Context())
	actx, err := withAnswer(ctx, rec, http.StatusNoContent, nil, "")
	if err != nil {
		return err
	}
	unbound, err := s.store.Unbind(actx, b.DeviceID, user.ID)
	switch {
	case errors.Is(err, companion.ErrNotFound):
		return errDeviceNotFound
	case err != nil:
		return err
	}
	rec = settled(c)
	// The user's unfinished commands ended with the binding: none of
	// them may reach the device, or its next owner's bridge.
	s.cmds.Ended(unbound.Ended)
	if s.accounts != nil {
		_ = s.accounts.Unbound(ctx, user.ID, b.DeviceID) // logged and retried there
	}
	if unbound.Bridge != "" {
		// The user's own bridge serves only the user's devices.
		s.moved(ctx, b.DeviceID, unbound.Bridge, "")
	}
	return s.reply(c, http.StatusNoContent, nil, "", rec, nil)
}

func (s *Server) deviceStatus(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	st, err := s.store.Status(c.Request.Context(), b.DeviceID)
	if err != nil {
		return err
	}
	return s.reply(c, http.StatusOK, toStatus(b.DeviceID, b.Model, st), "", nil, nil)
}

func (s *Server) deviceApps(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	st, err := s.store.Status(c.Request.Context(), b.DeviceID)
	if err != nil {
		return err
	}
	return s.reply(c, http.StatusOK, gin.H{"apps": toApps(st.Apps)}, "", nil, nil)
}
