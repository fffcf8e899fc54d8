package sim

import (
	"bytes"
	"context"
	"crypto/sha256"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/mcuboot"
)

// fuzzBufSize is the SMP buffer of the device FuzzPeripheral drives: small,
// so that answers near it are within the fuzzer's reach.
const fuzzBufSize = 512

// FuzzPeripheral hands the simulated device's SMP server whatever a central
// may write, message after message (as a packet of whole messages, the last
// one possibly cut short), and checks each answer as a stock MCUmgr client
// reads it: exactly one, whole, in the request's SMP version, with its
// group, command id and sequence, the op's answer, a body that decodes,
// and no longer than the device's buffer (Zephyr builds an answer in one
// of its SMP buffers: what does not fit is an error, never a longer one).
func FuzzPeripheral(f *testing.F) {
	msg := func(op uint8, group uint16, id uint8, body any) []byte {
		b, err := gatt.EncodeMessage(op, group, 1, id, body)
		if err != nil {
			f.Fatal(err)
		}
		return b
	}
	img := mcuboot.MustBuild([]byte("the application"), mcuboot.Options{Version: mcuboot.Version{Major: 2}})
	sum := sha256.Sum256(img)
	f.Add(msg(gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, gatt.EchoRequest{D: "hello"}))
	f.Add(msg(gatt.OpRead, gatt.GroupOS, gatt.CmdOSParams, nil))
	f.Add(msg(gatt.OpRead, gatt.GroupImage, gatt.CmdImageState, nil))
	f.Add(append(msg(gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, gatt.ImageUploadRequest{Off: 0, Len: uint64(len(img)), SHA: sum[:], Data: img[:40]}),
		msg(gatt.OpWrite, gatt.GroupImage, gatt.CmdImageUpload, gatt.ImageUploadRequest{Off: 40, Data: img[40:]})...))
	f.Add(msg(gatt.OpRead, gatt.GroupSettings, gatt.CmdSettingsValue, gatt.SettingReadRequest{Name: gatt.SettingsPrefix + "brightness"}))
	f.Add(msg(gatt.OpWrite, gatt.GroupSettings, gatt.CmdSettingsValue, gatt.SettingWriteRequest{Name: gatt.SettingsPrefix + "volume", Val: []byte{7, 0, 0, 0}}))
	f.Add(msg(gatt.OpRead, gatt.GroupSettingsSchema, gatt.CmdSchemaRead, nil))
	f.Add(msg(gatt.OpWrite, gatt.GroupText, gatt.CmdTextPush, gatt.TextRequest{CmdID: "c1", Title: "t", Text: "hi"}))
	text, _ := gatt.EncodeBody(gatt.TextBody{Text: "a longer text"})
	tsum := sha256.Sum256(text)
	f.Add(append(msg(gatt.OpWrite, gatt.GroupText, gatt.CmdTextUpload, gatt.UploadRequest{CmdID: "c2", Len: uint64(len(text)), SHA: tsum[:], Data: []byte{}}),
		msg(gatt.OpWrite, gatt.GroupText, gatt.CmdTextUpload, gatt.UploadRequest{CmdID: "c2", Off: 0, Data: text})...))
	f.Add(msg(gatt.OpRead, gatt.GroupApps, gatt.CmdAppsList, nil))
	f.Add(msg(gatt.OpWrite, gatt.GroupApps, gatt.CmdAppsUninstall, gatt.UninstallRequest{CmdID: "c3", AppID: "weather"}))
	f.Add([]byte{0x0a, 0, 0xff, 0xff, 0, 0, 1, 0, 0xa0}) // a header claiming more than came
	// An echo that fills the buffer: its answer, one byte longer in
	// zcbor's form, does not fit it.
	f.Add(msg(gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, gatt.EchoRequest{D: strings.Repeat("e", fuzzBufSize-gatt.HeaderSize-6)}))
	f.Fuzz(func(t *testing.T, data []byte) {
		log := slog.New(slog.DiscardHandler)
		p := NewPeripheral(New(Options{ID: "dev-1", Logger: log}), PeripheralOptions{BufSize: fuzzBufSize, MaxUpload: 1 << 16, Logger: log})
		defer p.Close()
		var notes [][]byte
		p.mu.Lock()
		p.mtu = 247
		p.notify = func(_ string, v []byte) { notes = append(notes, bytes.Clone(v)) }
		p.mu.Unlock()
		ctx := context.Background()
		for n := 0; len(data) >= gatt.HeaderSize && n < 16; n++ {
			h, _ := gatt.ParseHeader(data)
			end := min(gatt.HeaderSize+int(h.Len), len(data))
			m := gatt.Message{Header: h, Body: bytes.Clone(data[gatt.HeaderSize:end])}
			data = data[end:]

			notes = notes[:0]
			if !p.answer(ctx, h, p.handle(ctx, m)) {
				t.Fatal("the connection is gone")
			}
			r := gatt.NewReassembler(gatt.MaxMessage)
			var answers []gatt.Message
			for _, n := range notes {
				ms, err := r.Feed(n)
				if err != nil {
					t.Fatalf("answer to %+v: %v", h, err)
				}
				answers = append(answers, ms...)
			}
			if len(answers) != 1 || r.Pending() != 0 {
				t.Fatalf("request %+v: %d answers and %d bytes more", h, len(answers), r.Pending())
			}
			a := answers[0]
			want := gatt.OpWriteRsp
			if h.Op == gatt.OpRead {
				want = gatt.OpReadRsp
			}
			if a.Op != want || a.Version != min(h.Version, gatt.SMPv2) || a.Group != h.Group || a.ID != h.ID || a.Seq != h.Seq {
				t.Fatalf("request %+v answered %+v", h, a.Header)
			}
			var body map[string]any
			if err := gatt.DecodeBody(a.Body, &body); err != nil {
				t.Fatalf("request %+v: its answer does not decode: %v", h, err)
			}
			if n := gatt.HeaderSize + len(a.Body); n > fuzzBufSize {
				t.Fatalf("request %+v answered %d bytes, more than the device's %d-byte buffer", h, n, fuzzBufSize)
			}
		}
	})
}

// FuzzPeripheralWrites hands the device's SMP transport arbitrary writes,
// with and without reassembly, as a central may send them: whatever they
// hold, once the device has answered what it took, it holds no buffer but
// the one of a message still being collected, so that the next request
// finds its buffers free (a buffer leaked is a device that loses every
// request once they are gone), and it still answers an echo.
func FuzzPeripheralWrites(f *testing.F) {
	echo, _ := gatt.EncodeMessage(gatt.OpWrite, gatt.GroupOS, 7, gatt.CmdOSEcho, gatt.EchoRequest{D: "hi"})
	f.Add(echo, false, uint8(5))
	f.Add(append(append([]byte{}, echo...), echo...), true, uint8(3))
	f.Add([]byte{0x0a, 0, 0x01, 0x00, 0, 0, 1, 0}, false, uint8(8)) // a header claiming 256 bytes
	f.Add([]byte{0x0a, 0, 0xff, 0xff, 0, 0, 1, 0, 1, 2, 3}, true, uint8(0))
	f.Fuzz(func(t *testing.T, data []byte, noReassembly bool, split uint8) {
		log := slog.New(slog.DiscardHandler)
		p := NewPeripheral(New(Options{ID: "dev-1", Logger: log}), PeripheralOptions{BufSize: fuzzBufSize, BufCount: 3, NoReassembly: noReassembly,
			MaxUpload: 1 << 16, ResetDelay: time.Hour, Logger: log})
		defer p.Close()
		answers := make(chan []byte, 1024)
		if err := p.Connected(247, func(_ string, v []byte) {
			select {
			case answers <- bytes.Clone(v):
			default:
			}
		}, func() {}); err != nil {
			t.Fatal(err)
		}
		defer p.Disconnected()
		// Writes of split+1 bytes at most (an ATT write is at most MTU-3).
		for rest, n := data, int(split)%244+1; len(rest) > 0; {
			k := min(n, len(rest))
			p.WriteChar(gatt.SMPCharUUID, rest[:k])
			rest = rest[k:]
		}
		idle := func() bool {
			p.mu.Lock()
			defer p.mu.Unlock()
			held := 0
			if p.cur != nil {
				held = 1
			}
			return len(p.queue) == 0 && p.inUse == held
		}
		deadline := time.Now().Add(5 * time.Second)
		for !idle() {
			if time.Now().After(deadline) {
				p.mu.Lock()
				defer p.mu.Unlock()
				t.Fatalf("the device holds %d buffers, %d packets queued, collecting %v", p.inUse, len(p.queue), p.cur != nil)
			}
			time.Sleep(time.Millisecond)
		}
		p.mu.Lock()
		between := p.cur == nil // the next write starts a message
		p.mu.Unlock()
		if !between {
			return
		}
		for len(answers) > 0 {
			<-answers
		}
		probe, _ := gatt.EncodeMessage(gatt.OpWrite, gatt.GroupOS, 0x77, gatt.CmdOSEcho, gatt.EchoRequest{D: "probe"})
		p.WriteChar(gatt.SMPCharUUID, probe)
		r := gatt.NewReassembler(gatt.MaxMessage)
		for {
			select {
			case n := <-answers:
				ms, _ := r.Feed(n)
				for _, m := range ms {
					if m.Seq == 0x77 && m.Group == gatt.GroupOS {
						return
					}
				}
			case <-time.After(5 * time.Second):
				t.Fatal("no answer to an echo after the writes")
			}
		}
	})
}
