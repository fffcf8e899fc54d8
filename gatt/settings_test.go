package gatt_test

import (
	"context"
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
type schemaConnector struct {
	gatt.Connector
	extra topics.Schema
}

type schemaLink struct {
	gatt.Link
	extra  topics.Schema
	mu     sync.Mutex
	notify func([]byte)
}

func (c *schemaConnector) Connect(ctx context.Context, id string) (gatt.Link, error) {
	l, err := c.Connector.Connect(ctx, id)
	if err != nil {
		return nil, err
	}
	return &schemaLink{Link: l, extra: c.extra}, nil
}

func (l *schemaLink) Subscribe(ctx context.Context, uuid string, fn func([]byte)) error {
	l.mu.Lock()
	l.notify = fn
	l.mu.Unlock()
	return l.Link.Subscribe(ctx, uuid, fn)
}

func (l *schemaLink) Write(ctx context.Context, uuid string, data []byte, withResponse bool) error {
	h, err := gatt.ParseHeader(data)
	if err != nil || h.Group != gatt.GroupSettingsSchema || h.ID != gatt.CmdSchemaRead || h.Op != gatt.OpRead {
		return l.Link.Write(ctx, uuid, data, withResponse)
	}
	schema := sim.DefaultSchema()
	maps.Copy(schema, l.extra)
	body, err := gatt.EncodeBody(gatt.SchemaResponse{Schema: schema})
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
