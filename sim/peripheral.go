package sim

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/devicecompanion/companion/gatt"
)

// Defaults of PeripheralOptions. 2475 bytes is the SMP buffer Nordic
// recommends for fast DFU over Bluetooth (ten 247-byte writes plus headers).
const (
	DefaultBufSize   = 2475
	DefaultBufCount  = 4
	DefaultMaxUpload = 64 << 20
)

// PeripheralOptions configure a Peripheral. The zero value of a field means
// its default.
type PeripheralOptions struct {
	BufSize   int // the SMP receive buffer: the largest whole message; default DefaultBufSize
	BufCount  int // reported as buf_count; default DefaultBufCount
	MaxUpload int // the largest upload accepted; default DefaultMaxUpload
	Logger    *slog.Logger
}

// Peripheral is the device side of the GATT profile (docs/gatt.md) in front
// of a simulated Device: it serves the Device Information and Battery
// services and the SMP characteristic, reassembles requests, runs them one
// at a time in arrival order, receives chunked uploads (keeping the offset
// across reconnects and checking the SHA-256 at the end) and drops a
// repeated command id. It implements gatt.Peripheral.
type Peripheral struct {
	dev  *Device
	opts PeripheralOptions
	log  *slog.Logger

	// connMu orders Connected and Disconnected: a connection's serving
	// goroutine has ended before the next one starts (and wg.Add never
	// races wg.Wait), whichever goroutines the link calls them from.
	connMu sync.Mutex

	mu      sync.Mutex
	notify  func(charUUID string, value []byte)
	mtu     int
	reasm   *gatt.Reassembler
	queue   []gatt.Message
	wake    chan struct{}
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	uploads map[uint16]*upload // by group; kept across connections
}

type upload struct {
	first gatt.UploadRequest
	data  []byte
}

// NewPeripheral puts dev behind the GATT profile.
func NewPeripheral(dev *Device, opts PeripheralOptions) *Peripheral {
	if opts.BufSize <= 0 {
		opts.BufSize = DefaultBufSize
	}
	opts.BufSize = min(max(opts.BufSize, 64), gatt.MaxMessage)
	if opts.BufCount <= 0 {
		opts.BufCount = DefaultBufCount
	}
	if opts.MaxUpload <= 0 {
		opts.MaxUpload = DefaultMaxUpload
	}
	if opts.Logger == nil {
		opts.Logger = dev.log
	}
	return &Peripheral{dev: dev, opts: opts, log: opts.Logger.With("device", dev.ID(), "side", "peripheral"),
		uploads: map[uint16]*upload{}}
}

// Device returns the simulated device behind the peripheral.
func (p *Peripheral) Device() *Device { return p.dev }

// Services lists the profile's services.
func (p *Peripheral) Services() []gatt.Service {
	return []gatt.Service{
		{UUID: gatt.ServiceUUID, Characteristics: []gatt.Characteristic{
			{UUID: gatt.SMPCharUUID, Properties: []string{gatt.PropWrite, gatt.PropWriteWithoutResponse, gatt.PropNotify}},
		}},
		{UUID: gatt.BatteryServiceUUID, Characteristics: []gatt.Characteristic{
			{UUID: gatt.BatteryLevelUUID, Properties: []string{gatt.PropRead, gatt.PropNotify}},
		}},
		{UUID: gatt.DeviceInfoUUID, Characteristics: []gatt.Characteristic{
			{UUID: gatt.ModelNumberUUID, Properties: []string{gatt.PropRead}},
			{UUID: gatt.SerialNumberUUID, Properties: []string{gatt.PropRead}},
			{UUID: gatt.FirmwareRevUUID, Properties: []string{gatt.PropRead}},
		}},
	}
}

// ReadChar answers reads of the Device Information and Battery services.
func (p *Peripheral) ReadChar(charUUID string) ([]byte, error) {
	info, err := p.dev.Info(context.Background())
	if err != nil {
		return nil, err
	}
	switch charUUID {
	case gatt.ModelNumberUUID:
		return []byte(info.Model), nil
	case gatt.SerialNumberUUID:
		return []byte(p.dev.ID()), nil
	case gatt.FirmwareRevUUID:
		return []byte(info.FirmwareVersion), nil
	case gatt.BatteryLevelUUID:
		return []byte{byte(info.Battery)}, nil
	}
	return nil, fmt.Errorf("sim: characteristic %s is not readable", charUUID)
}

// WriteChar takes one write to the SMP characteristic.
func (p *Peripheral) WriteChar(charUUID string, data []byte) error {
	if charUUID != gatt.SMPCharUUID {
		return fmt.Errorf("sim: characteristic %s is not writable", charUUID)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.reasm == nil {
		return gatt.ErrDisconnected
	}
	msgs, err := p.reasm.Feed(data)
	if err != nil {
		p.log.Warn("dropping a malformed request stream", "err", err)
	}
	if len(msgs) > 0 {
		p.queue = append(p.queue, msgs...)
		select {
		case p.wake <- struct{}{}:
		default:
		}
	}
	return nil
}

// Connected starts serving a central.
func (p *Peripheral) Connected(mtu int, notify func(charUUID string, value []byte)) {
	p.connMu.Lock()
	defer p.connMu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	p.mu.Lock()
	p.notify, p.mtu, p.cancel = notify, mtu, cancel
	p.reasm = gatt.NewReassembler(p.opts.BufSize)
	p.queue = nil
	p.wake = make(chan struct{}, 1)
	wake := p.wake
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.serve(ctx, wake)
	}()
}

// Disconnected stops serving: the request being run is canceled and
// requests not yet run are forgotten; uploads keep their offsets.
func (p *Peripheral) Disconnected() {
	p.connMu.Lock()
	defer p.connMu.Unlock()
	p.mu.Lock()
	cancel := p.cancel
	p.notify, p.reasm, p.queue, p.cancel = nil, nil, nil, nil
	p.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	p.wg.Wait()
}

func (p *Peripheral) serve(ctx context.Context, wake chan struct{}) {
	for {
		p.mu.Lock()
		var m gatt.Message
		ok := len(p.queue) > 0 && ctx.Err() == nil
		if ok {
			m = p.queue[0]
			p.queue = p.queue[1:]
		}
		notify, mtu := p.notify, p.mtu
		p.mu.Unlock()
		if !ok {
			select {
			case <-ctx.Done():
				return
			case <-wake:
				continue
			}
		}
		rsp := p.handle(ctx, m)
		if ctx.Err() != nil || notify == nil {
			return
		}
		body, err := gatt.EncodeBody(rsp)
		if err != nil {
			p.log.Error("encoding a response", "err", err)
			continue
		}
		out := gatt.AppendHeader(nil, gatt.Header{Op: m.Op + 1, Len: uint16(len(body)), Group: m.Group, Seq: m.Seq, ID: m.ID})
		out = append(out, body...)
		for off := 0; off < len(out); off += mtu - 3 {
			notify(gatt.SMPCharUUID, out[off:min(off+mtu-3, len(out))])
		}
	}
}

func fail(rc int, err error) gatt.Status {
	return gatt.Status{RC: rc, Reason: err.Error()}
}

// status maps the device's errors to SMP return codes.
func status(err error) gatt.Status {
	switch {
	case err == nil:
		return gatt.Status{}
	case errors.Is(err, ErrBadArgument), errors.Is(err, ErrBadSettings):
		return fail(gatt.RCInvalid, err)
	case errors.Is(err, ErrAppNotInstalled):
		return fail(gatt.RCNotFound, err)
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return fail(gatt.RCTimeout, err)
	}
	return fail(gatt.RCUnknown, err)
}

// handle runs one request and returns the response body.
func (p *Peripheral) handle(ctx context.Context, m gatt.Message) any {
	bad := func(err error) any { return fail(gatt.RCInvalid, err) }
	read, write := m.Op == gatt.OpRead, m.Op == gatt.OpWrite
	switch {
	case m.Group == gatt.GroupOS && m.ID == gatt.CmdOSEcho && write:
		var req gatt.EchoRequest
		if err := gatt.DecodeBody(m.Body, &req); err != nil {
			return bad(err)
		}
		return gatt.EchoResponse{R: req.D}

	case m.Group == gatt.GroupOS && m.ID == gatt.CmdOSParams && read:
		return gatt.ParamsResponse{BufSize: p.opts.BufSize, BufCount: p.opts.BufCount}

	case m.Group == gatt.GroupSettings && m.ID == gatt.CmdSettingsAll && read:
		vals, schema, err := p.dev.Settings(ctx)
		if err != nil {
			return status(err)
		}
		return gatt.SettingsResponse{Values: vals, Schema: schema}

	case m.Group == gatt.GroupSettings && m.ID == gatt.CmdSettingsAll && write:
		var req gatt.SettingsRequest
		if err := gatt.DecodeBody(m.Body, &req); err != nil || req.CmdID == "" || len(req.Values) == 0 {
			return bad(fmt.Errorf("settings write needs cid and values: %v", err))
		}
		// The device's schema check speaks JSON's types: numbers as float64.
		vals := make(map[string]any, len(req.Values))
		for k, v := range req.Values {
			switch n := v.(type) {
			case uint64:
				v = float64(n)
			case int64:
				v = float64(n)
			}
			vals[k] = v
		}
		return status(p.dev.UpdateSettings(ctx, req.CmdID, vals))

	case m.Group == gatt.GroupText && m.ID == gatt.CmdTextPush && write:
		var req gatt.TextRequest
		if err := gatt.DecodeBody(m.Body, &req); err != nil || req.CmdID == "" || req.Text == "" {
			return bad(fmt.Errorf("text push needs cid and text: %v", err))
		}
		return status(p.dev.PushText(ctx, req.CmdID, req.Title, req.Text))

	case m.Group == gatt.GroupApps && m.ID == gatt.CmdAppsList && read:
		info, err := p.dev.Info(ctx)
		if err != nil {
			return status(err)
		}
		r := gatt.AppsResponse{Apps: []gatt.AppEntry{}}
		for _, a := range info.Apps {
			r.Apps = append(r.Apps, gatt.AppEntry{AppID: a.AppID, Version: a.Version})
		}
		return r

	case m.Group == gatt.GroupApps && m.ID == gatt.CmdAppsUninstall && write:
		var req gatt.UninstallRequest
		if err := gatt.DecodeBody(m.Body, &req); err != nil || req.CmdID == "" || req.AppID == "" {
			return bad(fmt.Errorf("uninstall needs cid and app_id: %v", err))
		}
		return status(p.dev.UninstallApp(ctx, req.CmdID, req.AppID))

	case write && (m.Group == gatt.GroupImage && m.ID == gatt.CmdImageUpload ||
		m.Group == gatt.GroupPush && m.ID == gatt.CmdPushUpload ||
		m.Group == gatt.GroupApps && m.ID == gatt.CmdAppsInstall):
		var req gatt.UploadRequest
		if err := gatt.DecodeBody(m.Body, &req); err != nil || req.CmdID == "" {
			return bad(fmt.Errorf("upload needs cid, off and data: %v", err))
		}
		return p.upload(ctx, m.Group, req)
	}
	return gatt.Status{RC: gatt.RCNotSupported, Reason: fmt.Sprintf("op %d of group %d command %d", m.Op, m.Group, m.ID)}
}

// upload takes one chunk (see docs/gatt.md, "Chunked upload") and answers
// the offset held.
func (p *Peripheral) upload(ctx context.Context, group uint16, req gatt.UploadRequest) any {
	p.mu.Lock()
	u := p.uploads[group]
	p.mu.Unlock()
	if req.Off == 0 && req.Len > 0 { // the first request of an upload
		switch {
		case len(req.SHA) != sha256.Size:
			return fail(gatt.RCInvalid, errors.New("sha must be 32 bytes of SHA-256"))
		case req.Len > uint64(p.opts.MaxUpload):
			return fail(gatt.RCNoMemory, fmt.Errorf("%d bytes is more than the %d this device takes", req.Len, p.opts.MaxUpload))
		case p.dev.Executions(req.CmdID) > 0: // done already: say so
			return gatt.UploadResponse{Off: req.Len}
		}
		if u == nil || u.first.CmdID != req.CmdID || !bytes.Equal(u.first.SHA, req.SHA) || u.first.Len != req.Len {
			first := req
			first.Data = nil
			u = &upload{first: first}
			p.mu.Lock()
			p.uploads[group] = u
			p.mu.Unlock()
		}
		if len(u.data) > 0 || len(req.Data) == 0 {
			return gatt.UploadResponse{Off: uint64(len(u.data))}
		}
	} else if u == nil || u.first.CmdID != req.CmdID {
		return fail(gatt.RCBadState, errors.New("no upload of this command in progress: start at off 0 with len and sha"))
	}
	held := uint64(len(u.data))
	if req.Off != held || len(req.Data) == 0 {
		return gatt.UploadResponse{Off: held}
	}
	if held+uint64(len(req.Data)) > u.first.Len {
		return fail(gatt.RCInvalid, fmt.Errorf("data runs past len %d", u.first.Len))
	}
	u.data = append(u.data, req.Data...)
	if uint64(len(u.data)) < u.first.Len {
		return gatt.UploadResponse{Off: uint64(len(u.data))}
	}

	// Complete: check the whole, then act on it.
	p.mu.Lock()
	delete(p.uploads, group)
	p.mu.Unlock()
	if sum := sha256.Sum256(u.data); !bytes.Equal(sum[:], u.first.SHA) {
		return fail(gatt.RCCorrupt, errors.New("the SHA-256 of the data does not match sha"))
	}
	var err error
	f := u.first
	switch group {
	case gatt.GroupImage:
		if !f.Upgrade {
			return gatt.UploadResponse{Off: f.Len} // stored, not booted
		}
		err = p.dev.UpdateFirmware(ctx, f.CmdID, f.Version, u.data, nil)
	case gatt.GroupPush:
		err = p.dev.PushImage(ctx, f.CmdID, f.ContentType, u.data)
	case gatt.GroupApps:
		err = p.dev.InstallApp(ctx, f.CmdID, f.AppID, f.Version, u.data)
	}
	if err != nil {
		return status(err)
	}
	return gatt.UploadResponse{Off: f.Len}
}
