package sim_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/sim"
)

// rawSMP speaks SMP to a simulated peripheral byte by byte, the way a
// stock MCUmgr client (or a test of the device) does: no gatt.Client.
type rawSMP struct {
	tb   testing.TB
	link gatt.Link
	msgs chan gatt.Message
	seq  uint8
}

func newRawSMP(tb testing.TB, mtu int, popts sim.PeripheralOptions) (*rawSMP, *sim.Device, *sim.Peripheral) {
	tb.Helper()
	return newRawSMPTo(tb, sim.Options{ID: "dev-1"}, mtu, popts)
}

// newRawSMPTo is newRawSMP to a device made with opts (its ID "dev-1").
func newRawSMPTo(tb testing.TB, opts sim.Options, mtu int, popts sim.PeripheralOptions) (*rawSMP, *sim.Device, *sim.Peripheral) {
	tb.Helper()
	opts.ID = "dev-1"
	d := sim.New(opts)
	p := sim.NewPeripheral(d, popts)
	n := sim.NewNetwork(sim.LinkOptions{MTU: mtu, KBPS: 100_000, Latency: -1, ConnectDelay: -1})
	n.Add("dev-1", p)
	tb.Cleanup(n.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	l, err := n.Connect(ctx, "dev-1")
	if err != nil {
		tb.Fatal(err)
	}
	r := &rawSMP{tb: tb, link: l, msgs: make(chan gatt.Message, 16)}
	reasm := gatt.NewReassembler(gatt.MaxMessage)
	if err := l.Subscribe(ctx, gatt.SMPCharUUID, func(b []byte) {
		ms, _ := reasm.Feed(b)
		for _, m := range ms {
			r.msgs <- m
		}
	}); err != nil {
		tb.Fatal(err)
	}
	return r, d, p
}

// send writes one request of SMP version v split into writes of the
// link's size, and returns the answer's header and body.
func (r *rawSMP) send(v, op uint8, group uint16, id uint8, body any) (gatt.Header, map[string]any) {
	r.tb.Helper()
	b, err := gatt.EncodeBody(body)
	if err != nil {
		r.tb.Fatal(err)
	}
	r.seq++
	msg := gatt.AppendHeader(nil, gatt.Header{Op: op, Version: v, Len: uint16(len(b)), Group: group, Seq: r.seq, ID: id})
	msg = append(msg, b...)
	r.write(msg)
	return r.answer()
}

func (r *rawSMP) write(msg []byte) {
	r.tb.Helper()
	frag := r.link.MTU() - 3
	for off := 0; off < len(msg); off += frag {
		if err := r.link.Write(context.Background(), gatt.SMPCharUUID, msg[off:min(off+frag, len(msg))], false); err != nil {
			r.tb.Fatal(err)
		}
	}
}

func (r *rawSMP) answer() (gatt.Header, map[string]any) {
	r.tb.Helper()
	select {
	case m := <-r.msgs:
		var v map[string]any
		if err := gatt.DecodeBody(m.Body, &v); err != nil {
			r.tb.Fatal(err)
		}
		return m.Header, v
	case <-time.After(3 * time.Second):
		r.tb.Fatal("no answer")
	}
	return gatt.Header{}, nil
}

// waitBoots waits until the device has booted n times: it reboots just
// after it drops the link.
func waitBoots(tb testing.TB, d *sim.Device, n int) {
	tb.Helper()
	testenv.Eventually(tb, 3*time.Second, "boot "+strconv.Itoa(n), func() bool { return d.Boots() >= n })
}

// The image group's upload is img_mgmt's: the request at off 0 needs len
// and an MCUboot header (rc 3 in version 1 otherwise; version 2 names the
// group's error), the answer to a version-2 request is version 2, a
// resumed upload answers the offset held, the last answer says match, and
// upgrade refuses an image not newer than the running one.
func TestImageUploadAsZephyr(t *testing.T) {
	r, d, _ := newRawSMP(t, 247, sim.PeripheralOptions{})
	img := mcuboot.MustBuild(bytes.Repeat([]byte("app "), 500), mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 2}})
	sum := sha256.Sum256(img)
	up := func(v uint8, body map[string]any) (gatt.Header, map[string]any) {
		return r.send(v, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, body)
	}
	rcOf := func(m map[string]any) any { return m["rc"] }
	errOf := func(m map[string]any) any {
		if e, ok := m["err"].(map[string]any); ok {
			return e["rc"]
		}
		return nil
	}
	for _, tt := range []struct {
		name  string
		body  map[string]any
		v1rc  uint64 // version 1: MCUmgr's rc
		v2err uint64 // version 2: the image group's error
	}{
		{"no len at off 0", map[string]any{"off": 0, "data": img[:100], "sha": sum[:]}, 3, gatt.ImgErrInvalidLength},
		{"no header at off 0", map[string]any{"off": 0, "len": len(img), "data": []byte("short"), "sha": sum[:]}, 3, gatt.ImgErrInvalidImageHeader},
		{"not MCUboot", map[string]any{"off": 0, "len": len(img), "data": bytes.Repeat([]byte{1}, 64), "sha": sum[:]}, 1, gatt.ImgErrInvalidImageHeaderMagic},
		{"no off", map[string]any{"len": len(img), "data": img[:64]}, 3, gatt.ImgErrInvalidOffset},
		{"upgrade to an older version", map[string]any{"off": 0, "len": 100, "upgrade": true,
			"data": mcuboot.MustBuild([]byte("old"), mcuboot.Options{Version: mcuboot.Version{Minor: 9}})[:64]}, 6, gatt.ImgErrCurrentVersionIsNewer},
	} {
		h, m := up(gatt.SMPv1, tt.body)
		if h.Version != gatt.SMPv1 || rcOf(m) != tt.v1rc {
			t.Errorf("%s, version 1: header version %d, body %v; want rc %d", tt.name, h.Version, m, tt.v1rc)
		}
		h, m = up(gatt.SMPv2, tt.body)
		if h.Version != gatt.SMPv2 || errOf(m) != tt.v2err || m["err"].(map[string]any)["group"] != uint64(gatt.GroupImage) {
			t.Errorf("%s, version 2: header version %d, body %v; want err {1, %d}", tt.name, h.Version, m, tt.v2err)
		}
	}

	// A good upload in version 2, cut after the first chunk and resumed.
	h, m := up(gatt.SMPv2, map[string]any{"off": 0, "len": len(img), "sha": sum[:], "data": img[:500]})
	if h.Version != gatt.SMPv2 || h.Op != gatt.OpWriteRsp || m["off"] != uint64(500) {
		t.Fatalf("first chunk: %+v %v", h, m)
	}
	_, m = up(gatt.SMPv2, map[string]any{"off": 0, "len": len(img), "sha": sum[:], "data": img[:500]})
	if m["off"] != uint64(500) {
		t.Errorf("resume: %v; want off 500, the offset held", m)
	}
	_, m = up(gatt.SMPv1, map[string]any{"off": 900, "data": img[900:1000]})
	if m["off"] != uint64(500) {
		t.Errorf("a chunk at the wrong offset: %v; want off 500 and nothing written", m)
	}
	_, m = up(gatt.SMPv1, map[string]any{"off": 500, "data": img[500:]})
	if m["off"] != uint64(len(img)) || m["match"] != true {
		t.Errorf("last chunk: %v; want off %d, match true", m, len(img))
	}

	// The image state lists it; a test, a reset, and the device runs it.
	parsed, _ := mcuboot.Parse(img)
	_, m = r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupImage, gatt.CmdImageState, map[string]any{})
	slots := m["images"].([]any)
	if len(slots) != 2 || !bytes.Equal(slots[1].(map[string]any)["hash"].([]byte), parsed.Hash) || slots[1].(map[string]any)["version"] != "1.2.0" {
		t.Fatalf("image state %v", m)
	}
	_, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageState, map[string]any{"hash": parsed.Hash, "confirm": false})
	if s := m["images"].([]any)[1].(map[string]any); s["pending"] != true {
		t.Fatalf("after test: %v", m)
	}
	_, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageState, map[string]any{"hash": parsed.Hash, "confirm": false})
	if m["err"] != nil || m["rc"] != nil {
		t.Errorf("test again: %v; want nothing to do", m)
	}
	if _, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSReset, map[string]any{}); len(m) != 0 {
		t.Errorf("reset: %v", m)
	}
	select {
	case <-r.link.Done():
	case <-time.After(3 * time.Second):
		t.Fatal("the device did not drop the link to reboot")
	}
	waitBoots(t, d, 1)
	if d.Firmware() != "1.2.0" || d.FirmwareConfirmed() {
		t.Errorf("after the reboot: firmware %s, confirmed %v; want 1.2.0 under test", d.Firmware(), d.FirmwareConfirmed())
	}
}

// Settings through settings_mgmt: read {name} → {val}, write {name, val},
// save; a value survives a reboot only once saved. Errors in version 2
// are the settings group's.
func TestSettingsAsZephyr(t *testing.T) {
	r, d, _ := newRawSMP(t, 23, sim.PeripheralOptions{})
	_, m := r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupSettings, gatt.CmdSettingsValue, map[string]any{"name": "companion/language"})
	if !bytes.Equal(m["val"].([]byte), []byte("en")) {
		t.Errorf("read language: %v", m)
	}
	_, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupSettings, gatt.CmdSettingsValue, map[string]any{"name": "companion/brightness", "val": []byte{80, 0, 0, 0}})
	if len(m) != 0 {
		t.Errorf("write brightness: %v", m)
	}
	_, m = r.send(gatt.SMPv1, gatt.OpRead, gatt.GroupSettings, gatt.CmdSettingsValue, map[string]any{"name": "companion/brightness"})
	if hex.EncodeToString(m["val"].([]byte)) != "50000000" {
		t.Errorf("read brightness: %v", m)
	}
	_, m = r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupSettings, gatt.CmdSettingsValue, map[string]any{"name": "companion/colour"})
	if e := m["err"].(map[string]any); e["group"] != uint64(gatt.GroupSettings) || e["rc"] != uint64(gatt.SettingsErrKeyNotFound) {
		t.Errorf("read an unknown key, version 2: %v", m)
	}
	_, m = r.send(gatt.SMPv1, gatt.OpRead, gatt.GroupSettings, gatt.CmdSettingsValue, map[string]any{"name": "companion/colour"})
	if m["rc"] != uint64(gatt.RCNotFound) {
		t.Errorf("read an unknown key, version 1: %v", m)
	}
	_, m = r.send(gatt.SMPv1, gatt.OpWrite, gatt.GroupSettings, gatt.CmdSettingsValue, map[string]any{"name": "companion/brightness", "val": []byte{200, 0, 0, 0}})
	if m["rc"] == nil {
		t.Errorf("write brightness 200: %v; want an error", m)
	}
	// Not saved yet: a reboot loses it.
	r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSReset, map[string]any{})
	<-r.link.Done()
	waitBoots(t, d, 1)
	vals, _, _ := d.Settings(context.Background())
	if vals["brightness"] != 50 {
		t.Errorf("brightness after a reboot without save = %v; want the default 50", vals["brightness"])
	}
}

// Settings load (command 3, read) is settings_load: it sets again the
// values the storage holds, and leaves those never saved, or deleted, as
// they are in use; delete removes the saved value, and the default comes
// back at the next boot.
func TestSettingsLoadAsZephyr(t *testing.T) {
	r, d, _ := newRawSMP(t, 23, sim.PeripheralOptions{})
	set := func(b byte) {
		t.Helper()
		if _, m := r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupSettings, gatt.CmdSettingsValue, map[string]any{"name": "companion/brightness", "val": []byte{b, 0, 0, 0}}); len(m) != 0 {
			t.Fatalf("write brightness %d: %v", b, m)
		}
	}
	load := func() byte {
		t.Helper()
		if _, m := r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupSettings, gatt.CmdSettingsSave, map[string]any{}); len(m) != 0 {
			t.Fatalf("load: %v", m)
		}
		_, m := r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupSettings, gatt.CmdSettingsValue, map[string]any{"name": "companion/brightness"})
		return m["val"].([]byte)[0]
	}
	set(80)
	if got := load(); got != 80 {
		t.Errorf("brightness after load, never saved = %d; want 80, as in use", got)
	}
	r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupSettings, gatt.CmdSettingsSave, map[string]any{})
	set(30)
	if got := load(); got != 80 {
		t.Errorf("brightness after load = %d; want the saved 80", got)
	}
	r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupSettings, gatt.CmdSettingsDelete, map[string]any{"name": "companion/brightness"})
	set(30)
	if got := load(); got != 30 {
		t.Errorf("brightness after delete and load = %d; want 30, as in use", got)
	}
	r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSReset, map[string]any{})
	<-r.link.Done()
	waitBoots(t, d, 1)
	if vals, _, _ := d.Settings(context.Background()); vals["brightness"] != 50 {
		t.Errorf("brightness after delete and a reboot = %v; want the default 50", vals["brightness"])
	}
}

// Without reassembly each write is a packet: a message split across writes
// is answered rc 9 and its tail dropped; with it, the buffers are
// reported by MCUmgr parameters and a split message is joined.
func TestReassemblyOption(t *testing.T) {
	for _, noReasm := range []bool{false, true} {
		r, _, p := newRawSMP(t, 23, sim.PeripheralOptions{NoReassembly: noReasm})
		_, m := r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupOS, gatt.CmdOSParams, map[string]any{})
		if m["buf_size"] != uint64(sim.DefaultBufSize) || m["buf_count"] != uint64(sim.DefaultBufCount) {
			t.Errorf("params %v", m)
		}
		// 25 bytes: a write of 20 and one of 5, too short for a header.
		_, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, map[string]any{"d": "thirteen char"})
		switch {
		case noReasm && m["rc"] != uint64(gatt.RCCorrupt):
			t.Errorf("split echo without reassembly: %v; want rc 9", m)
		case !noReasm && m["r"] != "thirteen char":
			t.Errorf("split echo with reassembly: %v", m)
		}
		_, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, map[string]any{"d": "short"})
		if m["r"] != "short" || p.Dropped() != 0 {
			t.Errorf("echo in one write (reassembly %v): %v, %d dropped", !noReasm, m, p.Dropped())
		}
		_, m = r.send(3, gatt.OpRead, gatt.GroupOS, gatt.CmdOSParams, map[string]any{})
		if m["rc"] != uint64(gatt.RCTooNew) {
			t.Errorf("SMP version 4: %v; want rc 13", m)
		}
		_, m = r.send(gatt.SMPv2, gatt.OpRead, 99, 0, map[string]any{})
		if m["rc"] != uint64(gatt.RCNotSupported) {
			t.Errorf("unknown group: %v; want rc 8", m)
		}
	}
}

// A central that connects again before the end of its last connection was
// reported (a Disconnect that raced a Connect in BlueZ) gets one
// connection: the old one's answers stop, the new one's are answered, and
// ending it returns.
func TestConnectedAgainEndsTheLastConnection(t *testing.T) {
	d := sim.New(sim.Options{ID: "dev-1"})
	p := sim.NewPeripheral(d, sim.PeripheralOptions{})
	t.Cleanup(func() { _ = p.Close() })
	notified := func(ch chan<- string, name string) func(string, []byte) {
		return func(string, []byte) {
			select {
			case ch <- name:
			default:
			}
		}
	}
	got := make(chan string, 16)
	if err := p.Connected(247, notified(got, "first"), func() {}); err != nil {
		t.Fatal(err)
	}
	if err := p.Connected(247, notified(got, "second"), func() {}); err != nil {
		t.Fatal(err)
	}
	b, err := gatt.EncodeBody(gatt.EchoRequest{D: "hi"})
	if err != nil {
		t.Fatal(err)
	}
	msg := gatt.AppendHeader(nil, gatt.Header{Op: gatt.OpWrite, Version: 1, Len: uint16(len(b)), Group: gatt.GroupOS, ID: gatt.CmdOSEcho})
	if err := p.WriteChar(gatt.SMPCharUUID, append(msg, b...)); err != nil {
		t.Fatal(err)
	}
	select {
	case who := <-got:
		if who != "second" {
			t.Fatalf("the answer went to the %s connection", who)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("no answer")
	}
	done := make(chan struct{})
	go func() {
		p.Disconnected()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		t.Fatal("Disconnected waits for the first connection, which nothing ends")
	}
}

// The device answers as Zephyr's zcbor encodes (CONFIG_ZCBOR_CANONICAL
// off, the default): maps and arrays of indefinite length.
func TestAnswersInZcborForm(t *testing.T) {
	r, _, _ := newRawSMP(t, 247, sim.PeripheralOptions{})
	for _, tt := range []struct {
		op    uint8
		group uint16
		id    uint8
		want  string
	}{
		{gatt.OpRead, gatt.GroupOS, gatt.CmdOSParams, "bf686275665f73697a651909ab696275665f636f756e7404ff"},
		{gatt.OpRead, gatt.GroupImage, gatt.CmdImageState, "bf66696d616765739fbf"},
		{gatt.OpRead, gatt.GroupOS, 99, "bf627263"},
	} {
		b, _ := gatt.EncodeBody(struct{}{})
		r.seq++
		r.write(append(gatt.AppendHeader(nil, gatt.Header{Op: tt.op, Version: gatt.SMPv2, Len: uint16(len(b)), Group: tt.group, Seq: r.seq, ID: tt.id}), b...))
		select {
		case m := <-r.msgs:
			if got := hex.EncodeToString(m.Body); !strings.HasPrefix(got, tt.want) || !strings.HasSuffix(got, "ff") {
				t.Errorf("answer to group %d command %d = %s; want %s…ff", tt.group, tt.id, got, tt.want)
			}
		case <-time.After(3 * time.Second):
			t.Fatal("no answer")
		}
	}
}

// sendRaw writes one request of SMP version v and returns the answer as it
// came, its body undecoded.
func (r *rawSMP) sendRaw(v, op uint8, group uint16, id uint8, body any) gatt.Message {
	r.tb.Helper()
	b, err := gatt.EncodeBody(body)
	if err != nil {
		r.tb.Fatal(err)
	}
	r.seq++
	r.write(append(gatt.AppendHeader(nil, gatt.Header{Op: op, Version: v, Len: uint16(len(b)), Group: group, Seq: r.seq, ID: id}), b...))
	select {
	case m := <-r.msgs:
		return m
	case <-time.After(3 * time.Second):
		r.tb.Fatal("no answer")
	}
	return gatt.Message{}
}

// A stock device's errors carry no "rsn": smp.c writes one only in the rc
// form and only with CONFIG_MCUMGR_SMP_VERBOSE_ERR_RESPONSE (off by
// default), and never beside a version 2 "err" (smp_add_cmd_err writes
// group and rc alone). The bodies are byte for byte what zcbor writes (the
// version 2 one is docs/gatt.md's example).
func TestErrorsAsZephyr(t *testing.T) {
	r, _, _ := newRawSMP(t, 247, sim.PeripheralOptions{})
	img := mcuboot.MustBuild(bytes.Repeat([]byte("app "), 100), mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 2}})
	noLen := map[string]any{"off": 0, "data": img[:64]}
	for _, tt := range []struct {
		name  string
		v, op uint8
		group uint16
		id    uint8
		body  any
		want  string
	}{
		{"no len at off 0, version 2", gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, noLen, "bf63657272bf6567726f75700162726315ffff"},
		{"no len at off 0, version 1", gatt.SMPv1, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, noLen, "bf62726303ff"},
		{"test without a hash", gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageState, map[string]any{"confirm": false}, "bf63657272bf6567726f7570016272631818ffff"},
		{"unknown key", gatt.SMPv2, gatt.OpRead, gatt.GroupSettings, gatt.CmdSettingsValue, map[string]any{"name": "companion/colour"}, "bf63657272bf6567726f75700362726303ffff"},
		{"unknown group", gatt.SMPv2, gatt.OpRead, 99, 0, map[string]any{}, "bf62726308ff"},
		{"unknown command", gatt.SMPv1, gatt.OpWrite, gatt.GroupOS, 99, map[string]any{}, "bf62726308ff"},
		{"SMP version 4", 3, gatt.OpRead, gatt.GroupOS, gatt.CmdOSParams, map[string]any{}, "bf6272630dff"},
	} {
		m := r.sendRaw(tt.v, tt.op, tt.group, tt.id, tt.body)
		if got := hex.EncodeToString(m.Body); got != tt.want {
			t.Errorf("%s: body %s; want %s", tt.name, got, tt.want)
		}
	}
}

// A request whose op is neither read nor write is no request: smp.c
// answers rc 8 (ENOTSUP), with op 3, as smp_rsp_op makes every op but a
// read a write response.
func TestNotARequestAsZephyr(t *testing.T) {
	r, _, _ := newRawSMP(t, 247, sim.PeripheralOptions{})
	for _, op := range []uint8{gatt.OpReadRsp, gatt.OpWriteRsp, 5} {
		m := r.sendRaw(gatt.SMPv2, op, gatt.GroupOS, gatt.CmdOSEcho, map[string]any{"d": "x"})
		if m.Op != gatt.OpWriteRsp || hex.EncodeToString(m.Body) != "bf62726308ff" {
			t.Errorf("op %d: answer op %d body %x; want op 3, {rc: 8}", op, m.Op, m.Body)
		}
	}
}

// img_mgmt's image erase (group 1, command 5, write; "slot" the other
// slot by default): it erases a slot that is neither running, nor to boot
// next, nor the one a test reverts to, ends the upload in progress, and
// answers an empty map; a slot in use is error 9 (no free slot; rc 6 in
// version 1). The first request is Apache newtmgr's (nmxact) "image
// erase", written out by hand.
func TestImageEraseAsZephyr(t *testing.T) {
	r, _, _ := newRawSMP(t, 247, sim.PeripheralOptions{})
	img := mcuboot.MustBuild(bytes.Repeat([]byte("app "), 300), mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 4}})
	parsed, _ := mcuboot.Parse(img)
	sum := sha256.Sum256(img)
	upload := func() {
		t.Helper()
		_, m := r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, map[string]any{"off": 0, "len": len(img), "sha": sum[:], "data": img})
		if m["off"] != uint64(len(img)) || m["match"] != true {
			t.Fatalf("upload: %v", m)
		}
	}
	slots := func() int {
		t.Helper()
		_, m := r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupImage, gatt.CmdImageState, map[string]any{})
		return len(m["images"].([]any))
	}
	raw := func(req string) gatt.Message {
		t.Helper()
		b, _ := hex.DecodeString(req)
		r.write(b)
		select {
		case m := <-r.msgs:
			return m
		case <-time.After(3 * time.Second):
			t.Fatalf("no answer to %s", req)
		}
		return gatt.Message{}
	}

	upload()
	if m := raw("0200000100011405a0"); m.Op != gatt.OpWriteRsp || hex.EncodeToString(m.Body) != "bfff" {
		t.Errorf("newtmgr's image erase: op %d body %x; want op 3, an empty map (bfff)", m.Op, m.Body)
	}
	if n := slots(); n != 1 {
		t.Errorf("after the erase the image state lists %d slots; want the running one only", n)
	}

	// An upload in progress ends with the erase.
	_, m := r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, map[string]any{"off": 0, "len": len(img), "sha": sum[:], "data": img[:100]})
	if m["off"] != uint64(100) {
		t.Fatalf("first chunk: %v", m)
	}
	if m := raw("0a00000100011505a0"); hex.EncodeToString(m.Body) != "bfff" {
		t.Errorf("erase during an upload: body %x; want bfff", m.Body)
	}
	if _, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, map[string]any{"off": 100, "data": img[100:200]}); m["off"] != uint64(0) {
		t.Errorf("a chunk after the erase: %v; want off 0, no upload", m)
	}

	// A pending image's slot, and the running one, are in use.
	upload()
	if _, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageState, map[string]any{"hash": parsed.Hash, "confirm": false}); m["err"] != nil {
		t.Fatalf("test: %v", m)
	}
	for _, tt := range []struct{ name, req, want string }{
		{"the pending slot, version 2", "0a00000100011605a0", "bf63657272bf6567726f75700162726309ffff"},
		{"the pending slot, version 1", "0200000100011705a0", "bf62726306ff"},
		{"slot 0, the running one", "0a00000700011805a164736c6f7400", "bf63657272bf6567726f75700162726309ffff"},
	} {
		if m := raw(tt.req); hex.EncodeToString(m.Body) != tt.want {
			t.Errorf("%s: body %x; want %s", tt.name, m.Body, tt.want)
		}
	}
	if n := slots(); n != 2 {
		t.Errorf("after refused erases the image state lists %d slots; want 2", n)
	}
}

// A stock handler decodes its keys with zcbor_map_decode_bulk: a key it
// reads whose value is of another type, null among them, fails its zcbor
// decoder, and the handler answers MGMT_ERR_EINVAL (rc 3 in either
// version) without doing anything; keys it does not read are skipped. The
// first request is what Apache newtmgr (nmxact) sends to confirm the
// running image, its unset hash encoded as null: a stock device refuses
// it. The others are the bridge's requests with a null where the bridge
// puts a value. The bytes are written out by hand, header and CBOR.
func TestNullFieldsRefusedAsZephyr(t *testing.T) {
	r, d, _ := newRawSMP(t, 247, sim.PeripheralOptions{})
	for _, tt := range []struct{ name, req string }{
		{"newtmgr's confirm {hash: null, confirm: true}, version 1", "0200001000010c00a26468617368f667636f6e6669726df5"},
		{"test {hash: null, confirm: false}", "0a00001000010d00a26468617368f667636f6e6669726df4"},
		{"upload chunk {off: 5, data: null}", "0a00000c00010e01a2636f6666056464617461f6"},
		{"settings write {name: companion/language, val: null}", "0a00001e00030f00a2646e616d6572636f6d70616e696f6e2f6c616e67756167656376616cf6"},
		{"echo {d: null}", "0a00000400001000a16164f6"},
	} {
		req, err := hex.DecodeString(tt.req)
		if err != nil {
			t.Fatal(err)
		}
		r.write(req)
		h, m := r.answer()
		if h.Seq != req[6] || m["rc"] != uint64(gatt.RCInvalid) || len(m) != 1 {
			t.Errorf("%s: answer seq %d %v; want rc %d and nothing else", tt.name, h.Seq, m, gatt.RCInvalid)
		}
	}
	if got, _, _ := d.Settings(context.Background()); got["language"] != "en" {
		t.Errorf("language after a write of null: %v; want en, unchanged", got["language"])
	}
}

// os_mgmt registers echo for read and write alike.
func TestEchoReadAsZephyr(t *testing.T) {
	r, _, _ := newRawSMP(t, 247, sim.PeripheralOptions{})
	h, m := r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupOS, gatt.CmdOSEcho, map[string]any{"d": "hi"})
	if h.Op != gatt.OpReadRsp || m["r"] != "hi" {
		t.Errorf("echo read: op %d, %v; want op 1, r hi", h.Op, m)
	}
}

// An answer that does not fit the device's SMP buffer is MGMT_ERR_EMSGSIZE
// (rc 7), as on Zephyr, whose handlers encode it in one: an echo that fills
// the buffer has an answer one byte longer (zcbor's indefinite map). With
// buffers of 65535 bytes, that answer's length did not fit the header's
// 16 bits, and went out with a header saying 0.
func TestAnswerLongerThanTheBufferAsZephyr(t *testing.T) {
	for _, bufSize := range []int{512, gatt.MaxMessage} {
		r, _, _ := newRawSMP(t, 247, sim.PeripheralOptions{BufSize: bufSize})
		// The map's head, the key "d" and a string head of three bytes.
		d := strings.Repeat("e", bufSize-gatt.HeaderSize-6)
		h, m := r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, map[string]any{"d": d})
		if h.Op != gatt.OpWriteRsp || m["rc"] != uint64(gatt.RCMsgSize) || len(m) != 1 {
			t.Errorf("buffers of %d: an echo that fills one answered op %d, %d bytes, %.40v; want {rc: 7}", bufSize, h.Op, h.Len, m)
		}
		h, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, map[string]any{"d": d[1:]})
		if m["r"] != d[1:] {
			t.Errorf("buffers of %d: an echo one byte shorter answered %d bytes, %.40v; want it echoed", bufSize, h.Len, m)
		}
	}
}

// img_mgmt's image state (CONFIG_MCUMGR_GRP_IMG_FRUGAL_LIST off, the
// default) lists every flag of a slot, false ones too, and ends with
// splitStatus 0.
func TestImageStateAsZephyr(t *testing.T) {
	r, _, _ := newRawSMP(t, 247, sim.PeripheralOptions{})
	_, m := r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupImage, gatt.CmdImageState, map[string]any{})
	if v, ok := m["splitStatus"]; !ok || v != uint64(0) {
		t.Errorf("image state %v; want splitStatus 0", m)
	}
	slots, _ := m["images"].([]any)
	if len(slots) != 1 {
		t.Fatalf("image state %v; want the running image", m)
	}
	s := slots[0].(map[string]any)
	want := map[string]any{"slot": uint64(0), "version": "1.0.0", "bootable": true, "pending": false,
		"confirmed": true, "active": true, "permanent": false}
	for k, v := range want {
		if got, ok := s[k]; !ok || got != v {
			t.Errorf("slot 0: %s = %v (present %v); want %v", k, got, ok, v)
		}
	}
	if _, ok := s["image"]; ok {
		t.Errorf("slot 0 names its image in a single-image build: %v", s)
	}
	if len(s) != len(want)+1 { // and the hash
		t.Errorf("slot 0 has %d fields: %v", len(s), s)
	}
}

// uploadWhole sends img to the image group in chunks, as a stock client
// does, and returns the last answer.
func (r *rawSMP) uploadWhole(img []byte) map[string]any {
	r.tb.Helper()
	sum := sha256.Sum256(img)
	var m map[string]any
	for off := 0; off < len(img); off += 1500 {
		body := map[string]any{"off": off, "data": img[off:min(off+1500, len(img))]}
		if off == 0 {
			body["len"], body["sha"] = len(img), sum[:]
		}
		_, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, body)
		if m["err"] != nil {
			r.tb.Fatalf("upload at %d: %v", off, m)
		}
	}
	return m
}

// slotHashes is the hash of each slot the image state lists, by slot.
func slotHashes(m map[string]any) map[uint64][]byte {
	out := map[uint64][]byte{}
	for _, s := range m["images"].([]any) {
		sl := s.(map[string]any)
		out[sl["slot"].(uint64)] = sl["hash"].([]byte)
	}
	return out
}

// A build with CONFIG_MCUBOOT_BOOTLOADER_USES_SHA512 reports an image's
// SHA-512 TLV as its hash (64 bytes, IMAGE_SHA_LEN), takes only such a
// hash to mark an image for test, leaves out of its image state a slot
// whose image has no SHA-512 TLV, and MCUboot boots only such images.
func TestSHA512BuildAsZephyr(t *testing.T) {
	r, d, _ := newRawSMPTo(t, sim.Options{ImageHash: mcuboot.TLVSHA512}, 247, sim.PeripheralOptions{})
	state := func() map[string]any {
		_, m := r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupImage, gatt.CmdImageState, map[string]any{})
		return m
	}
	if h := slotHashes(state()); len(h) != 1 || len(h[0]) != 64 {
		t.Fatalf("image state of a SHA-512 build: hashes %x; want slot 0's of 64 bytes", h)
	}

	// A SHA-256 image lands in the slot, but img_mgmt finds no hash in it.
	img256 := mcuboot.MustBuild(bytes.Repeat([]byte("app "), 500), mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 1}})
	if m := r.uploadWhole(img256); m["match"] != true {
		t.Fatalf("upload of a SHA-256 image: %v", m)
	}
	if h := slotHashes(state()); len(h) != 1 {
		t.Errorf("image state after a SHA-256 image: hashes %x; want slot 1 left out", h)
	}
	parsed, _ := mcuboot.Parse(img256)
	_, m := r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageState, map[string]any{"hash": parsed.Hash, "confirm": false})
	if e, _ := m["err"].(map[string]any); e == nil || e["rc"] != uint64(gatt.ImgErrInvalidHash) {
		t.Errorf("test with a 32-byte hash: %v; want err %d", m, gatt.ImgErrInvalidHash)
	}

	img512 := mcuboot.MustBuild(bytes.Repeat([]byte("app "), 500), mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 2}, Hash: mcuboot.TLVSHA512})
	if m := r.uploadWhole(img512); m["match"] != true {
		t.Fatalf("upload of a SHA-512 image: %v", m)
	}
	parsed, _ = mcuboot.Parse(img512)
	if h := slotHashes(state()); !bytes.Equal(h[1], parsed.Hash) {
		t.Fatalf("image state: slot 1's hash %x; want the SHA-512 TLV %x", h[1], parsed.Hash)
	}
	_, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageState, map[string]any{"hash": parsed.Hash, "confirm": false})
	if s := m["images"].([]any)[1].(map[string]any); s["pending"] != true {
		t.Fatalf("after test: %v", m)
	}
	r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSReset, map[string]any{})
	<-r.link.Done()
	waitBoots(t, d, 1)
	if d.Firmware() != "1.2.0" || d.FirmwareConfirmed() {
		t.Errorf("after the reboot: firmware %s, confirmed %v; want 1.2.0 under test", d.Firmware(), d.FirmwareConfirmed())
	}

	if _, err := sim.Open(sim.Options{ID: "x", ImageHash: mcuboot.TLVSHA384}); err == nil {
		t.Error("a device whose img_mgmt reads SHA-384 was made; Zephyr's reads SHA-256 or SHA-512")
	}
}

// An image padded to the slot (imgtool sign --pad or --confirm) sent
// whole writes its trailer at the end of the secondary slot, where
// MCUboot reads it: the boot magic asks for a test swap, and with image_ok
// set for a permanent one, before anyone marks the image. Where the
// padding ends short of the slot's end, the trailer is not MCUboot's.
func TestWholePaddedUploadWritesTheTrailer(t *testing.T) {
	const slot = 0x8000
	payload := bytes.Repeat([]byte("app "), 500)
	for _, tt := range []struct {
		name                string
		opts                mcuboot.Options
		pending, permanent  bool
		confirmedAfterReset bool
	}{
		{"--pad", mcuboot.Options{SlotSize: slot}, true, false, false},
		{"--confirm", mcuboot.Options{SlotSize: slot, Confirm: true}, true, true, true},
		{"--confirm, to a smaller slot than the device's", mcuboot.Options{SlotSize: slot / 2, Confirm: true}, false, false, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r, d, _ := newRawSMP(t, 247, sim.PeripheralOptions{MaxUpload: slot})
			tt.opts.Version = mcuboot.Version{Major: 1, Minor: 3}
			r.uploadWhole(mcuboot.MustBuild(payload, tt.opts))
			_, m := r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupImage, gatt.CmdImageState, map[string]any{})
			s := m["images"].([]any)[1].(map[string]any)
			if s["pending"] != tt.pending || s["permanent"] != tt.permanent {
				t.Fatalf("slot 1 after the upload: %v; want pending %v, permanent %v", s, tt.pending, tt.permanent)
			}
			r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSReset, map[string]any{})
			<-r.link.Done()
			waitBoots(t, d, 1)
			want := "1.0.0"
			if tt.pending {
				want = "1.3.0"
			}
			if d.Firmware() != want || d.FirmwareConfirmed() != tt.confirmedAfterReset {
				t.Errorf("after the reboot: firmware %s, confirmed %v; want %s, confirmed %v", d.Firmware(), d.FirmwareConfirmed(), want, tt.confirmedAfterReset)
			}
		})
	}
}

// upgrade refuses an image that is not newer than the running one by
// major.minor.revision only: img_mgmt_vercmp leaves the build number out
// unless CONFIG_MCUMGR_GRP_IMG_VERSION_CMP_USE_BUILD_NUMBER (off by
// default). And it reads the version from the header whatever else the
// header says.
func TestUpgradeAsZephyr(t *testing.T) {
	r, d, _ := newRawSMP(t, 247, sim.PeripheralOptions{})
	if d.Firmware() != "1.0.0" {
		t.Fatalf("firmware %s", d.Firmware())
	}
	first := func(v mcuboot.Version) map[string]any {
		img := mcuboot.MustBuild([]byte("new application"), mcuboot.Options{Version: v})
		sum := sha256.Sum256(img)
		return map[string]any{"off": 0, "len": len(img), "sha": sum[:], "data": img[:mcuboot.HeaderSize], "upgrade": true}
	}
	_, m := r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, first(mcuboot.Version{Major: 1, Build: 5}))
	if e, _ := m["err"].(map[string]any); e == nil || e["rc"] != uint64(gatt.ImgErrCurrentVersionIsNewer) {
		t.Errorf("upgrade to 1.0.0+5 from 1.0.0: %v; want err 27 (the build number is not compared)", m)
	}
	bad := first(mcuboot.Version{Major: 0, Minor: 9})
	hdr := bytes.Clone(bad["data"].([]byte))
	hdr[8], hdr[9] = 16, 0 // a header size shorter than the header: img_mgmt does not look
	bad["data"] = hdr
	_, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, bad)
	if e, _ := m["err"].(map[string]any); e == nil || e["rc"] != uint64(gatt.ImgErrCurrentVersionIsNewer) {
		t.Errorf("upgrade to 0.9.0 with an odd header size: %v; want err 27", m)
	}
	_, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, first(mcuboot.Version{Major: 1, Revision: 1}))
	if m["off"] != uint64(mcuboot.HeaderSize) {
		t.Errorf("upgrade to 1.0.1: %v; want off %d", m, mcuboot.HeaderSize)
	}
}

// img_mgmt_upload resets the upload in progress (img_mgmt_reset_upload)
// whenever img_mgmt_upload_inspect refuses a request: a request at off 0
// that is refused ends it, and the same sha then starts anew rather than
// resuming.
func TestRefusedUploadEndsTheUploadAsZephyr(t *testing.T) {
	r, _, _ := newRawSMP(t, 247, sim.PeripheralOptions{})
	img := mcuboot.MustBuild(bytes.Repeat([]byte("app "), 500), mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 2}})
	sum := sha256.Sum256(img)
	up := func(body map[string]any) map[string]any {
		_, m := r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, body)
		return m
	}
	if m := up(map[string]any{"off": 0, "len": len(img), "sha": sum[:], "data": img[:500]}); m["off"] != uint64(500) {
		t.Fatalf("first chunk: %v", m)
	}
	for _, refused := range []map[string]any{
		{"off": 0, "sha": sum[:], "data": img[:64]},                  // no len
		{"len": len(img), "sha": sum[:], "data": img[:64]},           // no off
		{"off": 0, "len": len(img), "sha": sum[:], "data": img[:16]}, // no header
	} {
		if m := up(refused); m["err"] == nil {
			t.Fatalf("%v: %v; want an error", refused, m)
		}
		if m := up(map[string]any{"off": 0, "len": len(img), "sha": sum[:], "data": img[:mcuboot.HeaderSize]}); m["off"] != uint64(mcuboot.HeaderSize) {
			t.Errorf("after a refused request (%v), the same sha again: %v; want off %d, a new upload", refused, m, mcuboot.HeaderSize)
		}
		if m := up(map[string]any{"off": mcuboot.HeaderSize, "data": img[mcuboot.HeaderSize:500]}); m["off"] != uint64(500) {
			t.Fatalf("second chunk: %v", m)
		}
	}
}

// A project upload's data is a byte string, empty in the request that
// opens the upload: null or absent, the simulator refuses the request, as
// a firmware decoding it with zcbor does (docs/gatt.md).
func TestProjectUploadDataIsAByteString(t *testing.T) {
	r, _, _ := newRawSMP(t, 247, sim.PeripheralOptions{})
	sum := sha256.Sum256([]byte("pic"))
	open := func(data any, with bool) map[string]any {
		t.Helper()
		body := map[string]any{"cid": "c1", "off": 0, "len": 3, "sha": sum[:], "content_type": "image/png"}
		if with {
			body["data"] = data
		}
		_, m := r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupPush, gatt.CmdPushUpload, body)
		return m
	}
	for name, m := range map[string]map[string]any{"null": open(nil, true), "absent": open(nil, false)} {
		if m["rc"] != uint64(gatt.RCInvalid) {
			t.Errorf("data %s: answer %v; want rc %d", name, m, gatt.RCInvalid)
		}
	}
	if m := open([]byte{}, true); m["off"] != uint64(0) || m["rc"] != nil {
		t.Errorf("empty data: answer %v; want off 0", m)
	}
}

// As smp.c does: a request whose answer finds no buffer free is answered
// rc 2 (MGMT_ERR_ENOMEM) in its own buffer, not run; and a request that
// fails in the SMP layer ends its packet, the requests after it in the
// same write unanswered.
func TestNoBufferAndFailedRequestsAsZephyr(t *testing.T) {
	r, d, p := newRawSMP(t, 247, sim.PeripheralOptions{NoReassembly: true, BufCount: 2})
	release := p.HoldBuffers(1)
	h, m := r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupText, gatt.CmdTextPush, gatt.TextRequest{CmdID: "t1", Text: "hi"})
	if h.Op != gatt.OpWriteRsp || m["rc"] != uint64(gatt.RCNoMemory) || len(m) != 1 {
		t.Errorf("no buffer for the answer: %+v %v; want rc 2 and nothing else", h, m)
	}
	if d.Executions("t1") != 0 {
		t.Error("the request was run")
	}
	release()
	if _, m := r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, gatt.EchoRequest{D: "after"}); m["r"] != "after" {
		t.Errorf("echo once the buffer is free: %v", m)
	}

	// Two requests in one write: an unknown group (rc 8), then an echo.
	unknown, err := gatt.EncodeMessage(gatt.OpRead, 99, 7, 0, struct{}{})
	if err != nil {
		t.Fatal(err)
	}
	echo, err := gatt.EncodeMessage(gatt.OpWrite, gatt.GroupOS, 8, gatt.CmdOSEcho, gatt.EchoRequest{D: "never"})
	if err != nil {
		t.Fatal(err)
	}
	r.write(append(unknown, echo...))
	if h, m := r.answer(); h.Group != 99 || m["rc"] != uint64(gatt.RCNotSupported) {
		t.Errorf("the first request's answer: %+v %v", h, m)
	}
	select {
	case m := <-r.msgs:
		t.Errorf("the request after a failed one in the same packet was answered: %+v", m.Header)
	case <-time.After(200 * time.Millisecond):
	}
}

// With OldMCUmgr the device is the MCUmgr of Zephyr 2.x: it answers in SMP
// version 1 whatever the request's version bits say, and without
// reassembly its smp.c hands a message cut short to the handler, whose
// decoder refuses it (rc 3 from the echo), where today's answers rc 9.
func TestOldMCUmgrAsZephyr2(t *testing.T) {
	r, _, p := newRawSMP(t, 23, sim.PeripheralOptions{OldMCUmgr: true, NoReassembly: true})
	h, m := r.send(gatt.SMPv2, gatt.OpRead, gatt.GroupOS, gatt.CmdOSParams, map[string]any{})
	if h.Version != gatt.SMPv1 || m["buf_size"] != uint64(sim.DefaultBufSize) {
		t.Errorf("params: header version %d, %v; want version 1 and the buffers", h.Version, m)
	}
	// 25 bytes: a write of 20 and one of 5, too short for a header.
	h, m = r.send(gatt.SMPv2, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, map[string]any{"d": "thirteen char"})
	if h.Version != gatt.SMPv1 || m["rc"] != uint64(gatt.RCInvalid) {
		t.Errorf("split echo: header version %d, %v; want version 1, rc 3", h.Version, m)
	}
	h, m = r.send(3, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, map[string]any{"d": "short"})
	if h.Version != gatt.SMPv1 || m["r"] != "short" || p.Dropped() != 0 {
		t.Errorf("echo with the version bits at 3: header version %d, %v, %d dropped; want version 1, the echo", h.Version, m, p.Dropped())
	}
}

// With reassembly, a message whose first write is dropped (longer than a
// buffer, or no buffer free) leaves nothing behind in Zephyr's
// smp_reassembly_collect: each later write is taken as the first of a new
// message, its first 8 bytes as a header. The simulator skipped the rest
// of the dropped message instead, so a client's handling of what a device
// makes of that rest went untested (docs/reliability.md, bug 469).
func TestTheRestOfADroppedMessageAsZephyr(t *testing.T) {
	echo, err := gatt.EncodeMessage(gatt.OpWrite, gatt.GroupOS, 9, gatt.CmdOSEcho, gatt.EchoRequest{D: "x"})
	if err != nil {
		t.Fatal(err)
	}
	// The first write of a message of 108 bytes: its header and 12 bytes.
	first := gatt.AppendHeader(nil, gatt.Header{Op: gatt.OpWrite, Version: gatt.SMPv2, Len: 100, Group: gatt.GroupOS, Seq: 8, ID: gatt.CmdOSEcho})
	first = append(first, bytes.Repeat([]byte{0x72}, 12)...)
	for _, tc := range []struct {
		name  string
		popts sim.PeripheralOptions
		held  int
	}{
		{"longer than a buffer", sim.PeripheralOptions{BufSize: 64}, 0},
		{"no buffer free", sim.PeripheralOptions{BufCount: 2}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, _, p := newRawSMP(t, 23, tc.popts)
			release := p.HoldBuffers(tc.held)
			r.write(first)
			testenv.Eventually(t, 3*time.Second, "the first write dropped", func() bool { return p.Dropped() == 1 })
			release()
			// What comes next is a whole echo: a new message to the device.
			r.write(echo)
			if h, m := r.answer(); h.Seq != 9 || m["r"] != "x" {
				t.Errorf("the write after a dropped first write: %+v %v; want the echo answered", h, m)
			}
			if p.Dropped() != 1 {
				t.Errorf("%d writes dropped; want 1", p.Dropped())
			}
		})
	}
}

// A device that serves one central does not advertise: another central (a
// second bridge in range, its own Network) cannot connect until the first
// link ends (docs/reliability.md, bug 486).
func TestASecondCentralFindsTheDeviceConnected(t *testing.T) {
	p := sim.NewPeripheral(sim.New(sim.Options{ID: "dev-1"}), sim.PeripheralOptions{})
	fast := sim.LinkOptions{Latency: -1, ConnectDelay: -1}
	n1, n2 := sim.NewNetwork(fast), sim.NewNetwork(fast)
	t.Cleanup(func() {
		n1.Close()
		n2.Close()
		_ = p.Close()
	})
	n1.Add("dev-1", p)
	n2.Add("dev-1", p)
	l1, err := n1.Connect(t.Context(), "dev-1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n2.Connect(t.Context(), "dev-1"); !errors.Is(err, sim.ErrConnectedElsewhere) {
		t.Fatalf("a second central connected to a device the first holds: %v; want ErrConnectedElsewhere", err)
	}
	if _, err := n1.Connect(t.Context(), "dev-1"); err != nil {
		t.Fatalf("the same central connecting again: %v", err)
	}
	select {
	case <-l1.Done():
	default:
		t.Fatal("the central's old link is still up")
	}
	n1.Drop("dev-1")
	if _, err := n2.Connect(t.Context(), "dev-1"); err != nil {
		t.Fatalf("once the first link dropped: %v", err)
	}
}
