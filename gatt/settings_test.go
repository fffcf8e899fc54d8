package gatt_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// schemaConnector makes its Connector's links answer the settings schema
// read (group 67) with the simulator's schema and extra: a firmware that
// declares settings its settings handler cannot give.
// The values of the settings named in held are the link's own: it answers
// their reads and takes their writes, in the bytes written.
type schemaConnector struct {
	gatt.Connector
	extra topics.Schema
	held  *heldValues
}

type heldValues struct {
	mu   sync.Mutex
	vals map[string][]byte // by settings key
}

type schemaLink struct {
	gatt.Link
	extra  topics.Schema
	held   *heldValues
	mu     sync.Mutex
	notify func([]byte)
}

func (c *schemaConnector) Connect(ctx context.Context, id string) (gatt.Link, error) {
	l, err := c.Connector.Connect(ctx, id)
	if err != nil {
		return nil, err
	}
	return &schemaLink{Link: l, extra: c.extra, held: c.held}, nil
}

// heldAnswer is the answer's body to a settings_mgmt value request of a
// setting the link holds, or nil.
func (l *schemaLink) heldAnswer(h gatt.Header, body []byte) any {
	if l.held == nil || h.Group != gatt.GroupSettings || h.ID != gatt.CmdSettingsValue {
		return nil
	}
	var req gatt.SettingWriteRequest
	if gatt.DecodeBody(body, &req) != nil {
		return nil
	}
	l.held.mu.Lock()
	defer l.held.mu.Unlock()
	if _, ok := l.held.vals[req.Name]; !ok {
		return nil
	}
	if h.Op == gatt.OpRead {
		return gatt.SettingReadResponse{Val: l.held.vals[req.Name]}
	}
	l.held.vals[req.Name] = req.Val
	return struct{}{}
}

func (l *schemaLink) Subscribe(ctx context.Context, uuid string, fn func([]byte)) error {
	l.mu.Lock()
	l.notify = fn
	l.mu.Unlock()
	return l.Link.Subscribe(ctx, uuid, fn)
}

func (l *schemaLink) Write(ctx context.Context, uuid string, data []byte, withResponse bool) error {
	h, err := gatt.ParseHeader(data)
	if err != nil {
		return l.Link.Write(ctx, uuid, data, withResponse)
	}
	answer := l.heldAnswer(h, data[gatt.HeaderSize:])
	if answer == nil && h.Group == gatt.GroupSettingsSchema && h.ID == gatt.CmdSchemaRead && h.Op == gatt.OpRead {
		schema := sim.DefaultSchema()
		maps.Copy(schema, l.extra)
		answer = gatt.SchemaResponse{Schema: schema}
	}
	if answer == nil {
		return l.Link.Write(ctx, uuid, data, withResponse)
	}
	body, err := gatt.EncodeBody(answer)
	if err != nil {
		return err
	}
	h.Op++
	h.Len = uint16(len(body))
	msg := append(gatt.AppendHeader(nil, h), body...)
	l.mu.Lock()
	notify := l.notify
	l.mu.Unlock()
	frag := l.MTU() - 3
	go func() { // as a device answers: after the write, in notifications of the MTU
		for off := 0; off < len(msg); off += frag {
			notify(msg[off:min(off+frag, len(msg))])
		}
	}()
	return nil
}

// A setting the device declares and cannot give is left out, spec and
// value, and the others are read: a name too long for settings_mgmt (the
// key "companion/NAME" of 32 bytes or more, CONFIG_MCUMGR_GRP_SETTINGS_NAME_LEN),
// one its handler does not know, one whose read is longer than the device
// takes, one whose value is not of its type. Any of them failed the whole
// read, and the device's settings were never reported (bug 148).
func TestASettingTheDeviceCannotGiveIsLeftOut(t *testing.T) {
	extra := topics.Schema{
		"a_setting_name_of_32_characters!": {Type: topics.SettingInt, Default: 1},
		"unknown":                          {Type: topics.SettingBool, Default: false},
		"x" + strings.Repeat("y", 3000):    {Type: topics.SettingString, Default: ""},
		"volume":                           {Type: topics.SettingBool, Default: false}, // four bytes on the device
	}
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(fastLink)
	n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{}))
	defer n.Close()
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &schemaConnector{Connector: n, extra: extra}, MinBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	values, schema, err := d.Settings(ctx)
	if err != nil {
		t.Fatalf("Settings: %v; want the settings the device gives", err)
	}
	want := sim.DefaultSchema()
	delete(want, "volume")
	if len(schema) != len(want) || len(values) != len(want) {
		t.Errorf("Settings = %v, %v; want the %d of the simulator's schema", values, schema, len(want))
	}
	for name, spec := range want {
		if schema[name].Type != spec.Type || values[name] == nil {
			t.Errorf("setting %q: spec %+v, value %v; want spec %+v and its value", name, schema[name], values[name], spec)
		}
	}
}

// An int setting the device holds in 8 bytes is read and written exactly,
// past 2^53 too, and written in 8 bytes, as its handler reads it (an
// int64_t): the bridge wrote every int as 4 bytes, and refused any past
// int32 (bug 151).
func TestAnEightByteSettingGoesExactly(t *testing.T) {
	const big = 1<<53 + 1 // 9007199254740993: a float64 holds 9007199254740992
	held := &heldValues{vals: map[string][]byte{gatt.SettingsPrefix + "counter": binary.LittleEndian.AppendUint64(nil, 7)}}
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(fastLink)
	n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{}))
	defer n.Close()
	extra := topics.Schema{"counter": {Type: topics.SettingInt, Default: 0}}
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &schemaConnector{Connector: n, extra: extra, held: held}, MinBackoff: time.Millisecond,
		Window: 1}) // the link's answers and the device's come in the order asked
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := d.UpdateSettings(ctx, "c1", map[string]any{"counter": int64(big), "volume": float64(9)}); err != nil {
		t.Fatalf("UpdateSettings: %v", err)
	}
	held.mu.Lock()
	val := held.vals[gatt.SettingsPrefix+"counter"]
	held.mu.Unlock()
	if want := binary.LittleEndian.AppendUint64(nil, big); !bytes.Equal(val, want) {
		t.Errorf("the device was written %x; want %x", val, want)
	}
	values, _, err := d.Settings(ctx)
	if err != nil || values["counter"] != int64(big) || values["volume"] != int64(9) {
		t.Errorf("Settings = %v, %v; want counter %d and volume 9", values, err, big)
	}
}

// A device that answers in SMP version 1 (an MCUmgr older than version 2
// ignores the header's version bits) gives a group's error as MCUmgr's rc,
// translated as Zephyr's settings_mgmt_translate_error_code does: a key
// its handler does not know is rc 5, ENOENT. A settings change of such a
// key fails as over version 2 ("key not found": invalid_payload), not
// not_installed, the code of an app the device does not have (bug 260).
func TestVersion1SettingsKeyNotFoundIsInvalidPayload(t *testing.T) {
	asVersion1 := func(_ gatt.Link, data []byte) ([]byte, error) {
		h, err := gatt.ParseHeader(data)
		if err != nil || gatt.HeaderSize+int(h.Len) != len(data) {
			return data, nil // not a whole message: the reassembly probe's
		}
		data = bytes.Clone(data)
		data[0] &^= 3 << 3
		return data, nil
	}
	for _, tt := range []struct {
		name string
		tap  func(gatt.Link, []byte) ([]byte, error)
	}{
		{"version 2", func(_ gatt.Link, data []byte) ([]byte, error) { return data, nil }},
		{"version 1", asVersion1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := sim.New(sim.Options{ID: "dev-1"})
			n := sim.NewNetwork(fastLink)
			n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{}))
			d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &tapConnector{Connector: n, tap: tt.tap}, MinBackoff: time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			defer n.Close()
			defer d.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err = d.UpdateSettings(ctx, "s1", map[string]any{"colour": 3.0})
			if code := errorCode(err); code != gatt.CodeInvalidPayload {
				t.Errorf("UpdateSettings of a key the device does not know = %v (code %q); want invalid_payload", err, code)
			}
		})
	}
}

// A value the device's settings handler refuses (h_set returns -EINVAL),
// which settings_mgmt reports as its error 5 in SMP version 2, is rc 1
// (EUNKNOWN) in version 1: settings_mgmt_translate_error_code has no other
// code for it. The settings change fails invalid_payload either way, as
// docs/gatt.md says, and changes nothing. Before, a device answering
// version 1 failed it device_error (bug 412).
func TestVersion1RefusedSettingValueIsInvalidPayload(t *testing.T) {
	v1 := &version1{}
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(fastLink)
	n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{}))
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &tapConnector{Connector: n, tap: v1.tap}, MinBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = d.UpdateSettings(ctx, "s1", map[string]any{"brightness": 500.0, "volume": 3.0})
	if code := errorCode(err); code != gatt.CodeInvalidPayload || !strings.Contains(err.Error(), "rc 1") {
		t.Errorf("UpdateSettings with a value the device refuses, version 1 = %v (code %q); want invalid_payload, rc 1", err, code)
	}
	if vals, _, _ := s.Settings(ctx); vals["brightness"] != 50 || vals["volume"] != 50 {
		t.Errorf("after the refused update: %v; want brightness 50, volume 50", vals)
	}
}

// A device whose settings handler gives a text setting as a C string, its
// terminator included (memcpy of strlen + 1), or a char array handed whole,
// NULs to its end, is read without them: "en\x00" read as such was no value
// of its enum, GET …/settings showed "en\u0000", and a change to "en" stayed
// pending for good, the device never reporting the same text (bug 576).
func TestATextSettingGivenAsACStringIsReadWithoutItsNULs(t *testing.T) {
	held := &heldValues{vals: map[string][]byte{
		gatt.SettingsPrefix + "language": []byte("en\x00"),
		gatt.SettingsPrefix + "timezone": []byte("Europe/Berlin\x00"),
		gatt.SettingsPrefix + "nickname": append([]byte("kitchen"), make([]byte, 9)...), // char nickname[16]
	}}
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(fastLink)
	n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{}))
	defer n.Close()
	extra := topics.Schema{"nickname": {Type: topics.SettingString, MaxLen: 15, Default: ""}}
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &schemaConnector{Connector: n, extra: extra, held: held}, MinBackoff: time.Millisecond,
		Window: 1}) // the link's answers and the device's come in the order asked
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	values, schema, err := d.Settings(ctx)
	if err != nil {
		t.Fatalf("Settings: %v", err)
	}
	for name, want := range map[string]string{"language": "en", "timezone": "Europe/Berlin", "nickname": "kitchen"} {
		if values[name] != want {
			t.Errorf("Settings()[%q] = %q; want %q", name, values[name], want)
		}
	}
	if errs := schema.Validate(map[string]any{"language": values["language"], "timezone": values["timezone"], "nickname": values["nickname"]}); len(errs) > 0 {
		t.Errorf("the values read are not values of the device's own schema: %v", errs)
	}
}
