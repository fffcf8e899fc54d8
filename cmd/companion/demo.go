package main

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/base32"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/google/uuid"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/internal/tlsclient"
	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// DemoFile is what --demo writes to DATA/demo.json (mode 0600).
type DemoFile struct {
	APIURL       string       `json:"api_url"`
	Token        string       `json:"token"`
	AdminToken   string       `json:"admin_token"`
	UserID       string       `json:"user_id"`
	Devices      []DemoDevice `json:"devices"`
	BridgeID     string       `json:"bridge_id"`
	BridgeSecret string       `json:"bridge_secret"`
}

// DemoDevice is one simulated device of the demo and its claim code.
type DemoDevice struct {
	DeviceID  string `json:"device_id"`
	ClaimCode string `json:"claim_code"`
}

// Demo is the --demo fleet: a user, three provisioned simulated devices, a
// firmware and an app in the catalogs, and an in-process bridge serving the
// devices over MQTT like any other bridge. The bridge reaches its devices
// over the simulated Bluetooth link (default MTU and rate), speaking the
// GATT profile of docs/gatt.md.
type Demo struct {
	File    DemoFile
	Sims    []*sim.Device
	agent   *agent.Agent
	network *sim.Network
	gatts   []*gatt.Device
	mqttURL string
	// caFile, with --tls-cert, is the server's certificate (absolute),
	// which the quick start's curl lines trust: no system may; mqttCAFile
	// likewise what its mosquitto_sub line trusts, with an mqtts:// broker.
	caFile, mqttCAFile string
	prefix             string // the MQTT topics'
	// db is the server's store, which the quick start reads to print an
	// OTA line that works on the device as it is now.
	db companion.Store

	cancel context.CancelFunc
	done   chan struct{}
}

const (
	demoModel    = "sim-1"
	demoBridgeID = "demo-bridge"
	// demoFirmware is the firmware the simulated devices start on, which
	// the demo publishes beside demoLatestFirmware: a device that runs the
	// latest already (the devices keep their firmware across starts, in
	// DATA/demo-sim) can go back to it.
	demoFirmware       = "1.0.0"
	demoLatestFirmware = "1.1.0"
)

func startDemo(ctx context.Context, m *Main, tree topics.Tree) (*Demo, error) {
	path := filepath.Join(m.Config.Data, "demo.json")
	f, err := loadOrCreateDemo(ctx, m, path)
	if err != nil {
		return nil, err
	}
	if m.Dynsec != nil {
		// demo.json keeps the secrets, so the accounts can be made (again)
		// on every start; until connected they wait in the driver's retries.
		_ = m.Dynsec.BridgeCreated(ctx, f.BridgeID, f.BridgeSecret)
		_ = m.Dynsec.UserCreated(ctx, f.UserID, f.Token)
	}
	d := &Demo{File: f, mqttURL: m.MQTTURL(), prefix: tree.Prefix(), db: m.DB}
	if d.caFile, err = absPath(m.Config.TLSCert); err != nil {
		return nil, err
	}
	// The CA the server's own client trusts (newBroker).
	if d.mqttCAFile, err = absPath(cmp.Or(m.Config.MQTTCA, m.Config.MQTTTLSCert)); err != nil {
		return nil, err
	}
	var devices []agent.Device
	d.network = sim.NewNetwork(sim.LinkOptions{})
	for _, dev := range f.Devices {
		// Their state in the data directory: the next start finds them as
		// this one leaves them (firmware, apps, settings), as a real
		// device is when its bridge restarts.
		s, err := sim.Open(sim.Options{ID: dev.DeviceID, Model: demoModel, Firmware: demoFirmware, Logger: m.Logger,
			StateDir: filepath.Join(m.Config.Data, "demo-sim")})
		if err != nil {
			d.closeDevices()
			return nil, err
		}
		d.Sims = append(d.Sims, s)
		d.network.Add(dev.DeviceID, sim.NewPeripheral(s, sim.PeripheralOptions{Logger: m.Logger}))
		g, err := gatt.NewDevice(gatt.DeviceOptions{ID: dev.DeviceID, Connector: d.network, Logger: m.Logger})
		if err != nil {
			return nil, err
		}
		d.gatts = append(d.gatts, g)
		devices = append(devices, g)
	}
	httpClient, err := demoHTTPClient(m.Config.TLSCert)
	if err != nil {
		d.closeDevices()
		return nil, err
	}
	d.agent, err = agent.New(agent.Options{
		HTTPClient: httpClient,
		TLSConfig:  m.mqttTLS,
		MQTTURL:    m.MQTTURL(),
		Username:   f.BridgeID,
		Password:   f.BridgeSecret,
		BridgeID:   f.BridgeID,
		APIURL:     m.APIURL(),
		DataDir:    filepath.Join(m.Config.Data, "demo-bridge"),
		Devices:    devices,
		Topics:     tree,
		Logger:     m.Logger.With("component", "demo-bridge"),
	})
	if err != nil {
		d.closeDevices()
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	d.cancel = cancel
	d.done = make(chan struct{})
	go func() {
		defer close(d.done)
		if err := d.agent.Run(runCtx); err != nil && !errors.Is(err, context.Canceled) {
			m.Logger.Error("demo bridge", "err", err)
		}
	}()
	d.awaitReports(ctx, m.DB)
	return d, nil
}

// demoReadyTimeout bounds how long startDemo waits for the first reports.
const demoReadyTimeout = 10 * time.Second

// awaitReports waits until every demo device has reported its settings
// through the bridge (over the simulated Bluetooth link that takes a few
// round trips), so that the quick start's lines work the moment they are
// printed. It gives up quietly after demoReadyTimeout.
func (d *Demo) awaitReports(ctx context.Context, db companion.Store) {
	ctx, cancel := context.WithTimeout(ctx, demoReadyTimeout)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for _, dev := range d.File.Devices {
		for {
			s, err := db.Settings(ctx, dev.DeviceID)
			if err == nil && len(s.Reported) > 0 {
				break
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}
}

// Close stops the demo bridge and waits for it.
func (d *Demo) Close() error {
	d.cancel()
	<-d.done
	err := d.agent.Close()
	d.closeDevices()
	return err
}

func (d *Demo) closeDevices() {
	for _, g := range d.gatts {
		g.Close()
	}
	d.network.Close()
	for _, s := range d.Sims {
		s.Close()
	}
}

// loadOrCreateDemo returns the demo's credentials from DATA/demo.json, or
// new ones when there is none, and makes the store hold what they name.
// They are written first to DATA/demo.pending.json and the store's records
// after, each made only when missing: a start killed at any point leaves
// either no file (then nothing of the demo may be in the store yet) or one
// that the next start completes the store from. demo.json itself is there
// only while what it holds works: it is taken away while the store is
// completed and written once it is, so that a user or a script that reads
// it as soon as it is there registers with a claim code the store holds
// (bug 574: the demo.json of a first start was read before its devices
// were provisioned, and registering answered 422 invalid_claim).
func loadOrCreateDemo(ctx context.Context, m *Main, path string) (DemoFile, error) {
	pending := filepath.Join(filepath.Dir(path), demoPendingFile)
	var f DemoFile
	from := path
	b, err := os.ReadFile(from)
	if errors.Is(err, os.ErrNotExist) {
		from = pending
		b, err = os.ReadFile(from)
	}
	switch {
	case err == nil:
		if err := json.Unmarshal(b, &f); err != nil {
			return f, fmt.Errorf("%s: %w", from, err)
		}
	case errors.Is(err, os.ErrNotExist):
		f = newDemoFile()
	default:
		return f, err
	}
	f.APIURL = m.APIURL()
	f.AdminToken = m.AdminToken()
	for i := range f.Devices {
		if f.Devices[i].ClaimCode == "" {
			// Lost before (see provisionDemo); a store made anew since
			// takes a new one.
			f.Devices[i].ClaimCode = claimCode()
		}
	}
	if err := writeDemo(pending, f); err != nil {
		return f, err
	}
	if err := removeDurably(path); err != nil {
		return f, err
	}
	if err := provisionDemo(ctx, m, &f); err != nil {
		return f, err
	}
	if err := writeDemo(path, f); err != nil {
		return f, err
	}
	return f, removeDurably(pending)
}

// demoPendingFile holds the demo's credentials in the data directory while
// a start makes the store hold them (loadOrCreateDemo).
const demoPendingFile = "demo.pending.json"

// removeDurably removes path, if there, and makes its removal durable.
func removeDurably(path string) error {
	if err := os.Remove(path); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	return syncDir(filepath.Dir(path))
}

// newDemoFile returns fresh credentials for the demo user, its bridge and
// its three devices.
func newDemoFile() DemoFile {
	f := DemoFile{
		Token:        randomToken("ctk_"),
		UserID:       uuid.NewString(),
		BridgeID:     demoBridgeID,
		BridgeSecret: randomToken("cbs_"),
	}
	for i := 1; i <= 3; i++ {
		f.Devices = append(f.Devices, DemoDevice{DeviceID: fmt.Sprintf("sim-%03d", i), ClaimCode: claimCode()})
	}
	return f
}

// provisionDemo makes the store hold the demo user, bridge, devices and
// catalog of f, making what is missing and keeping what is there.
//
// A record may be there under credentials f does not hold when an earlier
// demo.json is gone (deleted, or an older server killed before it wrote
// it). The bridge is then given f's secret, and the user made anew
// (a new f.UserID and f.Token) if f's id is taken. A device's claim code
// cannot be changed (the store has no way to): the device is bound to the
// demo user instead, and its claim code in f left empty.
func provisionDemo(ctx context.Context, m *Main, f *DemoFile) error {
	db, now := m.DB, m.Config.Now()
	if err := provisionDemoUser(ctx, db, now, f); err != nil {
		return err
	}
	if err := provisionDemoBridge(ctx, db, now, f); err != nil {
		return err
	}
	for i := range f.Devices {
		dev := &f.Devices[i]
		err := db.ProvisionDevice(ctx, companion.RegistryDevice{ID: dev.DeviceID, Model: demoModel, ClaimHash: companion.HashSecret(dev.ClaimCode), CreatedAt: now, BridgeID: f.BridgeID})
		switch {
		case err == nil:
			continue
		case !errors.Is(err, companion.ErrExists):
			return err
		}
		reg, err := db.RegistryDevice(ctx, dev.DeviceID)
		if err != nil {
			return err
		}
		if reg.BridgeID != f.BridgeID {
			if _, err := db.AssignDevice(ctx, dev.DeviceID, f.BridgeID, ""); err != nil {
				return err
			}
		}
		if bytes.Equal(reg.ClaimHash, companion.HashSecret(dev.ClaimCode)) {
			continue
		}
		dev.ClaimCode = ""
		_, bound, err := db.Bind(ctx, companion.Binding{DeviceID: dev.DeviceID, UserID: f.UserID, Name: dev.DeviceID, Model: reg.Model, BoundAt: now})
		switch {
		case errors.Is(err, companion.ErrBoundToOther):
			m.Logger.Warn("demo: the device's claim code went with an earlier demo.json and another user has it; delete the data directory for a new demo", "device_id", dev.DeviceID)
		case err != nil:
			return err
		case bound:
			m.Logger.Warn("demo: the device's claim code went with an earlier demo.json: it is bound to the demo user instead", "device_id", dev.DeviceID)
		}
	}
	// Something to install and something to update to.
	return publishDemoContent(ctx, db)
}

// provisionDemoUser makes the demo user of f, or a new one (a new id and
// token in f) when f's id is taken under another token.
func provisionDemoUser(ctx context.Context, db companion.Store, now time.Time, f *DemoFile) error {
	for {
		err := db.CreateUser(ctx, companion.User{ID: f.UserID, Name: "demo", TokenHash: companion.HashSecret(f.Token), CreatedAt: now})
		if !errors.Is(err, companion.ErrExists) {
			return err
		}
		u, err := db.User(ctx, f.UserID)
		if err == nil && bytes.Equal(u.TokenHash, companion.HashSecret(f.Token)) {
			return nil
		}
		if err != nil && !errors.Is(err, companion.ErrNotFound) {
			return err
		}
		f.UserID, f.Token = uuid.NewString(), randomToken("ctk_")
	}
}

// provisionDemoBridge makes the demo bridge with f's secret. A demo bridge
// already there under another secret is given f's: it keeps its devices.
func provisionDemoBridge(ctx context.Context, db companion.Store, now time.Time, f *DemoFile) error {
	bridge := companion.Bridge{ID: f.BridgeID, SecretHash: companion.HashSecret(f.BridgeSecret), CreatedAt: now}
	err := db.CreateBridge(ctx, bridge)
	if !errors.Is(err, companion.ErrExists) {
		return err
	}
	old, err := db.Bridge(ctx, f.BridgeID)
	if err != nil {
		return err
	}
	if bytes.Equal(old.SecretHash, bridge.SecretHash) {
		return nil
	}
	return db.SetBridgeSecret(ctx, f.BridgeID, "", bridge.SecretHash)
}

// publishDemoContent publishes a firmware to update to and an app in two
// versions, those an earlier start has not published already (random
// content again under the same version would be refused).
func publishDemoContent(ctx context.Context, db companion.Store) error {
	if err := publishDemoFirmware(ctx, db); err != nil {
		return err
	}
	for _, v := range []string{"1.0.0", "1.1.0"} {
		if _, err := db.AppRelease(ctx, "weather", v); !errors.Is(err, companion.ErrNotFound) {
			if err != nil {
				return err
			}
			continue
		}
		pkg, err := randomBytes(40 << 10)
		if err != nil {
			return err
		}
		blob, err := db.PutBlob(ctx, bytes.NewReader(pkg), int64(len(pkg)))
		if err != nil {
			return err
		}
		if err := db.PutAppRelease(ctx, companion.AppRelease{AppID: "weather", Version: v, SHA256: blob.SHA256, Size: blob.Size}); err != nil {
			return err
		}
	}
	return nil
}

// publishDemoFirmware publishes firmware demoFirmware and
// demoLatestFirmware of the demo's model, MCUboot images as a Zephyr build
// signs them, each unless it is there already.
func publishDemoFirmware(ctx context.Context, db companion.Store) error {
	for _, v := range []string{demoFirmware, demoLatestFirmware} {
		if _, err := db.Firmware(ctx, demoModel, v); !errors.Is(err, companion.ErrNotFound) {
			if err != nil {
				return err
			}
			continue
		}
		version, err := mcuboot.ParseVersion(v)
		if err != nil {
			return err
		}
		app, err := randomBytes(256 << 10)
		if err != nil {
			return err
		}
		img, err := mcuboot.Build(app, mcuboot.Options{Version: version, HeaderSize: 0x200})
		if err != nil {
			return err
		}
		fw, err := db.PutBlob(ctx, bytes.NewReader(img), int64(len(img)))
		if err != nil {
			return err
		}
		if err := db.PutFirmware(ctx, companion.Firmware{Model: demoModel, Version: v, SHA256: fw.SHA256, Size: fw.Size}); err != nil {
			return err
		}
	}
	return nil
}

func randomBytes(size int) ([]byte, error) {
	b := make([]byte, size)
	_, err := rand.Read(b)
	return b, err
}

// writeDemo writes demo.json and makes its name durable too: the store's
// records that follow it must not outlive it in a power cut.
func writeDemo(path string, f DemoFile) error {
	b, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return err
	}
	if err := writeFileAtomic(path, append(b, '\n'), 0o600); err != nil {
		return err
	}
	return syncDir(filepath.Dir(path))
}

// syncDir makes the names in dir durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// claimCode returns 100 random bits as five groups of four base32 letters,
// easy to type and hopeless to guess.
func claimCode() string {
	b := make([]byte, 13)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	s := base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(b)[:20]
	var parts []string
	for i := 0; i < len(s); i += 4 {
		parts = append(parts, s[i:i+4])
	}
	return strings.Join(parts, "-")
}

// PrintQuickStart prints curl lines that work as printed against this run.
func (d *Demo) PrintQuickStart(w io.Writer) {
	f := d.File
	api := f.APIURL + "/api/v1"
	auth := fmt.Sprintf("-H 'Authorization: Bearer %s'", f.Token)
	js := "-H 'Content-Type: application/json'"
	dev := f.Devices[0]
	register := fmt.Sprintf(`curl -s -X POST %s/devices/register %s %s -d '{"device_id":"%s","claim_code":"%s","name":"Kitchen"}'`,
		api, auth, js, dev.DeviceID, dev.ClaimCode)
	if dev.ClaimCode == "" {
		register = fmt.Sprintf("# %s is bound to the demo user already (its claim code went with an earlier demo.json)", dev.DeviceID)
	}
	otaBody, otaNote := d.quickStartOTA(dev.DeviceID)
	var out strings.Builder
	fmt.Fprintf(&out, `
Demo ready: user "demo", bridge %q serving %d simulated devices. Credentials are in %s.
Try (each line works as printed):

  # bind a device to the demo user, then read it
  %s
  curl -s %s/devices %s
  curl -s %s/devices/%s/status %s

  # push text and wait up to 10 s for the device to take it
  curl -s -X POST %s/devices/%s/push/text %s %s -H 'Prefer: wait=10' -d '{"title":"Hello","text":"Hi from the cloud"}'

  # settings, apps, firmware
  curl -s %s/devices/%s/settings %s
  curl -s -X PUT %s/devices/%s/settings %s %s -H 'Prefer: wait=10' -d '{"brightness":80,"language":"de"}'
  curl -s -X POST %s/devices/%s/apps/install %s %s -H 'Prefer: wait=10' -d '{"app_id":"weather","version":"1.0.0"}'
  curl -s %s/devices/%s/ota/check %s%s
  curl -s -X POST %s/devices/%s/ota/update %s %s -H 'Prefer: wait=30' -d '%s'
  curl -s %s/devices/%s/commands %s

  # watch the device's MQTT conversation (user id and API token as credentials)
  %s -u %s -P %s -v -t '%s/devices/%s/#'

`,
		f.BridgeID, len(f.Devices), "demo.json in the data directory",
		register,
		api, auth,
		api, dev.DeviceID, auth,
		api, dev.DeviceID, auth, js,
		api, dev.DeviceID, auth,
		api, dev.DeviceID, auth, js,
		api, dev.DeviceID, auth, js,
		api, dev.DeviceID, auth, otaNote,
		api, dev.DeviceID, auth, js, otaBody,
		api, dev.DeviceID, auth,
		d.mosquittoSub(), f.UserID, f.Token, d.prefix, dev.DeviceID,
	)
	text := out.String()
	if d.caFile != "" {
		text = strings.ReplaceAll(text, "curl -s ", "curl -s --cacert "+shellQuote(d.caFile)+" ")
	}
	io.WriteString(w, text)
	if len(f.Devices) > 1 {
		fmt.Fprintln(w, "  other devices and their claim codes:")
		for _, dv := range f.Devices[1:] {
			code := dv.ClaimCode
			if code == "" {
				code = "(bound to the demo user already)"
			}
			fmt.Fprintf(w, "    %s  %s\n", dv.DeviceID, code)
		}
		fmt.Fprintln(w)
	}
}

// quickStartOTA returns the body of the quick start's OTA line that works
// on the device as it is now, and a line that says why when it is not the
// latest firmware: an update without a version is a 409 no_update on a
// device that runs the latest already, as a device does on the next start
// of a demo whose quick start it ran (the simulated devices keep their
// firmware in DATA/demo-sim). Such a device is sent back to demoFirmware.
func (d *Demo) quickStartOTA(deviceID string) (body, note string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := d.db.Status(ctx, deviceID)
	if err != nil || !topics.ValidVersion(st.FirmwareVersion) || st.FirmwareVersion == demoFirmware {
		return "{}", ""
	}
	fws, err := d.db.Firmwares(ctx, demoModel)
	if err != nil {
		return "{}", ""
	}
	for _, fw := range fws {
		if topics.CompareVersions(fw.Version, st.FirmwareVersion) > 0 {
			return "{}", ""
		}
	}
	return fmt.Sprintf(`{"version":"%s"}`, demoFirmware),
		fmt.Sprintf("\n  # %s runs %s, the latest: the OTA line takes it back to %s (the next start's updates it again)", deviceID, st.FirmwareVersion, demoFirmware)
}

// mosquittoSub is the quick start's mosquitto_sub up to its credentials:
// the broker (the first of a list), and with mqtts:// the CA to trust.
func (d *Demo) mosquittoSub() string {
	first, _, _ := strings.Cut(d.mqttURL, ",")
	host, port := "127.0.0.1", "1883"
	if u, err := url.Parse(first); err == nil {
		if h := u.Hostname(); h != "" && !net.ParseIP(h).IsUnspecified() {
			host = h
		}
		port = cmp.Or(u.Port(), port)
	}
	sub := "mosquitto_sub -h " + host + " -p " + port
	switch {
	case !tlsclient.IsTLSURL(first):
	case d.mqttCAFile != "":
		sub += " --cafile " + shellQuote(d.mqttCAFile)
	default:
		sub += " --capath /etc/ssl/certs"
	}
	return sub
}

// absPath is path made absolute, so that a line printed with it works
// from any directory; "" stays "".
func absPath(path string) (string, error) {
	if path == "" {
		return "", nil
	}
	return filepath.Abs(path)
}

// shellQuote quotes s for sh.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// demoHTTPClient is the demo bridge's client for blob downloads: with
// --tls-cert it trusts the server's own certificate, which may be
// self-signed.
func demoHTTPClient(certFile string) (*http.Client, error) {
	if certFile == "" {
		return nil, nil
	}
	c, err := tlsclient.Config(certFile)
	if err != nil {
		return nil, err
	}
	return tlsclient.HTTPClient(c), nil
}
