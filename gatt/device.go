package gatt

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/devicecompanion/companion/topics"
)

// Info is what a device reports about itself. It is an alias of the same
// unnamed struct as agent.Info, so that *Device satisfies agent.Device
// without this package importing agent.
type Info = struct {
	Model           string
	FirmwareVersion string
	Battery         int
	Apps            []topics.App
}

// Defaults of DeviceOptions.
const (
	DefaultConnectTimeout = 10 * time.Second
	DefaultMinBackoff     = 50 * time.Millisecond
	DefaultMaxBackoff     = 5 * time.Second
	// busyRetries is how often a request answered "busy" is repeated.
	busyRetries = 5
)

// DeviceOptions configure a Device. The zero value of a field means its
// default.
type DeviceOptions struct {
	ID        string    // required: the device id, which the device reports as its serial number
	Connector Connector // required

	ConnectTimeout time.Duration // per attempt; default DefaultConnectTimeout
	RequestTimeout time.Duration // per SMP request; default DefaultRequestTimeout
	MinBackoff     time.Duration // first pause between connection attempts; default DefaultMinBackoff
	MaxBackoff     time.Duration // longest pause; default DefaultMaxBackoff
	// Window is the most upload chunks in flight; 0 means the device's
	// buf_count (MCUmgr parameters), or DefaultWindow if it does not say.
	Window int
	Logger *slog.Logger
}

// Device is a device reached over GATT. It satisfies agent.Device: it
// connects on demand, reconnects with backoff when the link drops, repeats
// a request the link lost (the device drops a repeated command id) and
// resumes an upload from the offset the device holds. It is safe for
// concurrent use.
type Device struct {
	opts DeviceOptions
	log  *slog.Logger

	connMu sync.Mutex // held while connecting: one attempt at a time

	mu     sync.Mutex
	sess   *session
	closed bool
	stats  []TransferStats // of finished uploads, for tests and benchmarks
}

type session struct {
	client   *Client
	bufSize  int
	bufCount int
}

// ErrClosed is returned by a closed Device.
var ErrClosed = errors.New("gatt: device closed")

// NewDevice checks the options; it does not connect.
func NewDevice(opts DeviceOptions) (*Device, error) {
	if !topics.ValidDeviceID(opts.ID) {
		return nil, fmt.Errorf("gatt: invalid device id %q", opts.ID)
	}
	if opts.Connector == nil {
		return nil, errors.New("gatt: no connector")
	}
	if opts.ConnectTimeout <= 0 {
		opts.ConnectTimeout = DefaultConnectTimeout
	}
	if opts.RequestTimeout <= 0 {
		opts.RequestTimeout = DefaultRequestTimeout
	}
	if opts.MinBackoff <= 0 {
		opts.MinBackoff = DefaultMinBackoff
	}
	if opts.MaxBackoff < opts.MinBackoff {
		opts.MaxBackoff = max(DefaultMaxBackoff, opts.MinBackoff)
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	return &Device{opts: opts, log: opts.Logger.With("device", opts.ID)}, nil
}

// ID returns the device id.
func (d *Device) ID() string { return d.opts.ID }

// Close disconnects; later calls fail with ErrClosed.
func (d *Device) Close() error {
	d.mu.Lock()
	s := d.sess
	d.sess, d.closed = nil, true
	d.mu.Unlock()
	if s != nil {
		return s.client.Close()
	}
	return nil
}

// TransferStats returns the costs of the uploads finished so far, oldest
// first.
func (d *Device) TransferStats() []TransferStats {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]TransferStats(nil), d.stats...)
}

func alive(s *session) bool {
	select {
	case <-s.client.Done():
		return false
	default:
		return true
	}
}

// session returns the live connection, connecting (with backoff between
// attempts) until ctx is done.
func (d *Device) session(ctx context.Context) (*session, error) {
	if s, err := d.current(); s != nil || err != nil {
		return s, err
	}
	d.connMu.Lock()
	defer d.connMu.Unlock()
	backoff := d.opts.MinBackoff
	for {
		if s, err := d.current(); s != nil || err != nil {
			return s, err
		}
		s, err := d.connect(ctx)
		if err == nil {
			d.mu.Lock()
			if d.closed {
				d.mu.Unlock()
				s.client.Close()
				return nil, ErrClosed
			}
			d.sess = s
			d.mu.Unlock()
			return s, nil
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("gatt: connect to %s: %w", d.opts.ID, err)
		}
		d.log.Debug("connection attempt failed", "err", err, "retry_in", backoff)
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("gatt: connect to %s: %w", d.opts.ID, err)
		case <-t.C:
		}
		backoff = min(2*backoff, d.opts.MaxBackoff)
	}
}

func (d *Device) current() (*session, error) {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, ErrClosed
	}
	s := d.sess
	if s != nil && alive(s) {
		d.mu.Unlock()
		return s, nil
	}
	d.sess = nil
	d.mu.Unlock()
	if s != nil {
		s.client.Close() // the link is down already; release it
	}
	return nil, nil
}

// connect makes one attempt: connect, subscribe, check the serial number,
// learn the device's buffers.
func (d *Device) connect(ctx context.Context) (*session, error) {
	cctx, cancel := context.WithTimeout(ctx, d.opts.ConnectTimeout)
	defer cancel()
	link, err := d.opts.Connector.Connect(cctx, d.opts.ID)
	if err != nil {
		return nil, err
	}
	c, err := NewClient(cctx, link, ClientOptions{RequestTimeout: d.opts.RequestTimeout, Logger: d.log})
	if err != nil {
		link.Close()
		return nil, err
	}
	serial, err := link.Read(cctx, SerialNumberUUID)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("read serial number: %w", err)
	}
	if string(serial) != d.opts.ID {
		c.Close()
		return nil, fmt.Errorf("the device reports serial number %q, not %q", serial, d.opts.ID)
	}
	p, err := c.Params(cctx)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("MCUmgr parameters: %w", err)
	}
	s := &session{client: c, bufSize: p.BufSize, bufCount: p.BufCount}
	if s.bufSize <= 0 {
		s.bufSize = link.MTU() - 3 // a device that does not say takes one write
	}
	d.log.Debug("connected", "mtu", link.MTU(), "buf_size", s.bufSize, "buf_count", s.bufCount)
	return s, nil
}

// retry runs fn over the live session, again over a new one whenever the
// link drops, and again after a pause when the device is busy.
func (d *Device) retry(ctx context.Context, fn func(*session) error) error {
	busy := 0
	for {
		s, err := d.session(ctx)
		if err != nil {
			return err
		}
		err = fn(s)
		var e *Error
		switch {
		case err == nil:
			return nil
		case IsDisconnect(err) && ctx.Err() == nil:
			d.log.Debug("link lost; reconnecting", "err", err)
			continue
		case errors.Is(err, ErrTimeout):
			// A device that does not answer is presumed wedged: drop the
			// link so that the next request starts on a fresh one.
			s.client.Close()
			return err
		case errors.As(err, &e) && e.Temporary() && busy < busyRetries:
			busy++
			t := time.NewTimer(d.opts.MinBackoff << busy)
			select {
			case <-ctx.Done():
				t.Stop()
				return ctx.Err()
			case <-t.C:
			}
			continue
		}
		return err
	}
}

func (d *Device) do(ctx context.Context, op uint8, group uint16, id uint8, req, resp any) error {
	return d.retry(ctx, func(s *session) error { return s.client.Do(ctx, op, group, id, req, resp) })
}

// Info reads the Device Information and Battery services and lists the
// installed apps.
func (d *Device) Info(ctx context.Context) (Info, error) {
	var info Info
	err := d.retry(ctx, func(s *session) error {
		link := s.client.Link()
		model, err := link.Read(ctx, ModelNumberUUID)
		if err != nil {
			return err
		}
		fw, err := link.Read(ctx, FirmwareRevUUID)
		if err != nil {
			return err
		}
		batt, err := link.Read(ctx, BatteryLevelUUID)
		if err != nil {
			return err
		}
		if len(batt) != 1 || batt[0] > 100 {
			return fmt.Errorf("gatt: battery level %x is not one byte 0–100", batt)
		}
		var apps AppsResponse
		if err := s.client.Do(ctx, OpRead, GroupApps, CmdAppsList, nil, &apps); err != nil {
			return err
		}
		info = Info{Model: string(model), FirmwareVersion: string(fw), Battery: int(batt[0]), Apps: []topics.App{}}
		for _, a := range apps.Apps {
			info.Apps = append(info.Apps, topics.App{AppID: a.AppID, Version: a.Version})
		}
		sort.Slice(info.Apps, func(i, j int) bool { return info.Apps[i].AppID < info.Apps[j].AppID })
		return nil
	})
	return info, err
}

// Settings reads every setting and the schema (settings group).
func (d *Device) Settings(ctx context.Context) (map[string]any, topics.Schema, error) {
	var r SettingsResponse
	if err := d.do(ctx, OpRead, GroupSettings, CmdSettingsAll, nil, &r); err != nil {
		return nil, nil, err
	}
	if r.Values == nil {
		r.Values = map[string]any{}
	}
	return r.Values, r.Schema, nil
}

// PushText shows a text (group 64).
func (d *Device) PushText(ctx context.Context, cmdID, title, text string) error {
	return d.do(ctx, OpWrite, GroupText, CmdTextPush, TextRequest{CmdID: cmdID, Title: title, Text: text}, nil)
}

// PushImage uploads a picture to show (group 65).
func (d *Device) PushImage(ctx context.Context, cmdID, contentType string, data []byte) error {
	return d.upload(ctx, Upload{Group: GroupPush, ID: CmdPushUpload,
		First: UploadRequest{CmdID: cmdID, ContentType: contentType}, Data: data})
}

// InstallApp uploads an app package, installing or updating it (group 66).
func (d *Device) InstallApp(ctx context.Context, cmdID, appID, version string, pkg []byte) error {
	return d.upload(ctx, Upload{Group: GroupApps, ID: CmdAppsInstall,
		First: UploadRequest{CmdID: cmdID, AppID: appID, Version: version}, Data: pkg})
}

// UninstallApp removes an app (group 66); the device answers RCNotFound
// for one that is not installed.
func (d *Device) UninstallApp(ctx context.Context, cmdID, appID string) error {
	return d.do(ctx, OpWrite, GroupApps, CmdAppsUninstall, UninstallRequest{CmdID: cmdID, AppID: appID}, nil)
}

// UpdateSettings changes some settings (settings group). Whole numbers
// travel as CBOR integers, whatever JSON made of them.
func (d *Device) UpdateSettings(ctx context.Context, cmdID string, values map[string]any) error {
	vals := make(map[string]any, len(values))
	for k, v := range values {
		if f, ok := v.(float64); ok && f == math.Trunc(f) && math.Abs(f) < 1<<53 {
			v = int64(f)
		}
		vals[k] = v
	}
	return d.do(ctx, OpWrite, GroupSettings, CmdSettingsAll, SettingsRequest{CmdID: cmdID, Values: vals}, nil)
}

// UpdateFirmware uploads a firmware image with the image group's upload and
// upgrade set: the device checks it, boots it and then reports version.
func (d *Device) UpdateFirmware(ctx context.Context, cmdID, version string, image []byte, progress func(pct int)) error {
	u := Upload{Group: GroupImage, ID: CmdImageUpload,
		First: UploadRequest{CmdID: cmdID, Version: version, Upgrade: true}, Data: image}
	if progress != nil {
		u.Progress = func(acked, total int) { progress(acked * 100 / max(total, 1)) }
	}
	return d.upload(ctx, u)
}

// upload runs a chunked transfer to the end, across reconnects.
func (d *Device) upload(ctx context.Context, u Upload) error {
	if len(u.Data) == 0 {
		return &Error{Group: u.Group, ID: u.ID, RC: RCInvalid, Reason: "nothing to upload"}
	}
	t := NewTransfer(u)
	err := d.retry(ctx, func(s *session) error {
		window := d.opts.Window
		if window <= 0 {
			window = s.bufCount
		}
		if window <= 0 {
			window = DefaultWindow
		}
		return t.Run(ctx, s.client, s.bufSize, window)
	})
	st := t.Stats()
	d.mu.Lock()
	d.stats = append(d.stats, st)
	if len(d.stats) > 64 {
		d.stats = d.stats[len(d.stats)-64:]
	}
	d.mu.Unlock()
	if err != nil {
		return fmt.Errorf("upload (%d bytes, %s): %w", len(u.Data), strings.ToLower(groupName(u.Group)), err)
	}
	d.log.Debug("upload done", "group", u.Group, "bytes", len(u.Data), "attempts", st.Attempts, "sent", st.DataBytesSent)
	return nil
}

func groupName(g uint16) string {
	switch g {
	case GroupImage:
		return "firmware"
	case GroupPush:
		return "image"
	case GroupApps:
		return "app"
	}
	return fmt.Sprintf("group %d", g)
}
