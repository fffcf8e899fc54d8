package gatt

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestHeaderRoundTrip(t *testing.T) {
	for _, tt := range []struct {
		h    Header
		want string
	}{
		{Header{Op: OpWrite, Flags: 0, Len: 0x0102, Group: GroupApps, Seq: 7, ID: CmdAppsInstall}, "0200010200420701"},
		// SMP version 2 is bit 3 of the first byte (Zephyr's nh_version).
		{Header{Op: OpReadRsp, Version: SMPv2, Len: 5, Group: GroupImage, Seq: 255, ID: CmdImageState}, "090000050001ff00"},
	} {
		b := AppendHeader(nil, tt.h)
		if got := hex.EncodeToString(b); got != tt.want {
			t.Errorf("AppendHeader(%+v) = %s; want %s", tt.h, got, tt.want)
		}
		got, err := ParseHeader(b)
		if err != nil || got != tt.h {
			t.Errorf("ParseHeader(%x) = %+v, %v; want %+v", b, got, err, tt.h)
		}
	}
	b := AppendHeader(nil, Header{})
	if _, err := ParseHeader(b[:7]); !errors.Is(err, ErrShortHeader) {
		t.Errorf("ParseHeader(7 bytes) = %v; want ErrShortHeader", err)
	}
}

func TestMessageRoundTrip(t *testing.T) {
	tests := []struct {
		name  string
		group uint16
		id    uint8
		body  any
		into  func() any
	}{
		{"echo", GroupOS, CmdOSEcho, EchoRequest{D: "hi"}, func() any { return &EchoRequest{} }},
		{"image upload", GroupImage, CmdImageUpload, ImageUploadRequest{Off: 0, Len: 5, SHA: bytes.Repeat([]byte{1}, 32), Data: []byte("hello"), Upgrade: true}, func() any { return &ImageUploadRequest{} }},
		{"app upload", GroupApps, CmdAppsInstall, UploadRequest{CmdID: "c", Off: 0, Len: 5, SHA: bytes.Repeat([]byte{1}, 32), Data: []byte("hello"), AppID: "a", Version: "1.1.0"}, func() any { return &UploadRequest{} }},
		{"image state", GroupImage, CmdImageState, ImageStateRequest{Hash: bytes.Repeat([]byte{2}, 32)}, func() any { return &ImageStateRequest{} }},
		{"text", GroupText, CmdTextPush, TextRequest{CmdID: "c", Title: "t", Text: "x"}, func() any { return &TextRequest{} }},
		{"setting", GroupSettings, CmdSettingsValue, SettingWriteRequest{Name: "companion/language", Val: []byte("de")}, func() any { return &SettingWriteRequest{} }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			msg, err := EncodeMessage(OpWrite, tt.group, 9, tt.id, tt.body)
			if err != nil {
				t.Fatal(err)
			}
			// Split into 20-byte writes (MTU 23) and join again.
			r := NewReassembler(4096)
			var got []Message
			for off := 0; off < len(msg); off += 20 {
				ms, err := r.Feed(msg[off:min(off+20, len(msg))])
				if err != nil {
					t.Fatal(err)
				}
				got = append(got, ms...)
			}
			if len(got) != 1 || got[0].Group != tt.group || got[0].ID != tt.id || got[0].Seq != 9 || r.Pending() != 0 {
				t.Fatalf("reassembled %+v", got)
			}
			v := tt.into()
			if err := DecodeBody(got[0].Body, v); err != nil {
				t.Fatal(err)
			}
			again, _ := EncodeBody(v)
			first, _ := EncodeBody(tt.body)
			if !bytes.Equal(again, first) {
				t.Errorf("round trip %x; want %x", again, first)
			}
		})
	}
}

func TestReassemblerJoinsAndRejects(t *testing.T) {
	a, _ := EncodeMessage(OpReadRsp, GroupOS, 1, CmdOSParams, ParamsResponse{BufSize: 2475, BufCount: 4})
	b, _ := EncodeMessage(OpWriteRsp, GroupOS, 2, CmdOSEcho, EchoResponse{R: "x"})
	r := NewReassembler(64)
	ms, err := r.Feed(append(append([]byte(nil), a...), b...)) // two in one fragment
	if err != nil || len(ms) != 2 || ms[1].Seq != 2 {
		t.Fatalf("Feed(two messages) = %d messages, %v", len(ms), err)
	}
	long := AppendHeader(nil, Header{Op: OpWrite, Len: 100})
	if _, err := r.Feed(long); !errors.Is(err, ErrTooLong) {
		t.Errorf("Feed(header claiming 108 bytes, limit 64) = %v; want ErrTooLong", err)
	}
	if r.Pending() != 0 {
		t.Errorf("after an error the reassembler holds %d bytes", r.Pending())
	}
}

func TestDecodeLimits(t *testing.T) {
	deep := bytes.Repeat([]byte{0x81}, 100) // 100 nested arrays
	deep = append(deep, 0x00)
	var v any
	if err := DecodeBody(deep, &v); err == nil {
		t.Error("DecodeBody(100 nested arrays) = nil; want an error")
	}
	// A map header claiming 2^32 pairs in a few bytes.
	if err := DecodeBody([]byte{0xba, 0xff, 0xff, 0xff, 0xff}, &v); err == nil {
		t.Error("DecodeBody(huge map) = nil; want an error")
	}
	// The same in indefinite length, as zcbor writes maps and arrays: too
	// deep, too many pairs, too many elements, never closed.
	indef := append(bytes.Repeat([]byte{0x9f}, 100), bytes.Repeat([]byte{0xff}, 100)...)
	if err := DecodeBody(indef, &v); err == nil {
		t.Error("DecodeBody(100 nested indefinite arrays) = nil; want an error")
	}
	pairs := []byte{0xbf}
	for i := range 300 {
		pairs = append(pairs, 0x19, byte(i>>8), byte(i), 0x00)
	}
	if err := DecodeBody(append(pairs, 0xff), &v); err == nil {
		t.Error("DecodeBody(indefinite map of 300 pairs) = nil; want an error")
	}
	elems := append(append([]byte{0x9f}, bytes.Repeat([]byte{0x00}, 2000)...), 0xff)
	if err := DecodeBody(elems, &v); err == nil {
		t.Error("DecodeBody(indefinite array of 2000 elements) = nil; want an error")
	}
	if err := DecodeBody([]byte{0xbf, 0x62, 'r', 'c', 0x00}, &v); err == nil {
		t.Error("DecodeBody(indefinite map never closed) = nil; want an error")
	}
	// A byte string claiming 4 GiB.
	var u UploadRequest
	if err := DecodeBody([]byte{0xa1, 0x64, 'd', 'a', 't', 'a', 0x5a, 0xff, 0xff, 0xff, 0xff}, &u); err == nil {
		t.Error("DecodeBody(huge byte string) = nil; want an error")
	}
}

// FuzzReassemble feeds arbitrary bytes, split at an arbitrary point, to the
// reassembler and decodes every message it yields as each body type: no
// input may panic or make a message longer than the limit.
func FuzzReassemble(f *testing.F) {
	seed, _ := EncodeMessage(OpWrite, GroupImage, 1, CmdImageUpload, ImageUploadRequest{Len: 3, SHA: make([]byte, 32), Data: []byte("abc")})
	f.Add(seed, uint8(20))
	echo, _ := EncodeMessage(OpWrite, GroupOS, 0, CmdOSEcho, EchoRequest{D: "hello"})
	f.Add(echo, uint8(3))
	f.Add([]byte{0x02, 0x00, 0xff, 0xff, 0, 0, 0, 0}, uint8(1))
	// An answer as Zephyr's zcbor writes it: maps of indefinite length.
	zcbor, _ := hex.DecodeString("0900001900000106bf686275665f73697a651909ab696275665f636f756e7404ff")
	f.Add(zcbor, uint8(9))
	f.Fuzz(func(t *testing.T, data []byte, split uint8) {
		r := NewReassembler(512)
		n := int(split)%(len(data)+1) + 0
		var msgs []Message
		for _, part := range [][]byte{data[:n], data[n:]} {
			ms, _ := r.Feed(part)
			msgs = append(msgs, ms...)
		}
		for _, m := range msgs {
			if HeaderSize+len(m.Body) > 512 {
				t.Fatalf("message of %d bytes past the limit", len(m.Body))
			}
			var a any
			_ = DecodeBody(m.Body, &a)
			var u UploadRequest
			_ = DecodeBody(m.Body, &u)
			var s ImageStateResponse
			_ = DecodeBody(m.Body, &s)
			var st Status
			_ = DecodeBody(m.Body, &st)
		}
	})
}

// The profile is Zephyr's: a stock MCUmgr device serves these.
func TestZephyrUUIDs(t *testing.T) {
	if ServiceUUID != "8d53dc1d-1db7-4cd3-868b-8a527460aa84" || SMPCharUUID != "da2e7828-fbce-4e01-ae9e-261174997c48" {
		t.Errorf("SMP service %s, characteristic %s; want Zephyr's", ServiceUUID, SMPCharUUID)
	}
}

// cannedClient is a Client on a canned link, closed when the test ends.
func cannedClient(t *testing.T, ctx context.Context, link Link, opts ClientOptions) *Client {
	t.Helper()
	c, err := NewClient(ctx, link, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// cannedLink is a device that answers each SMP request with a body given
// as hex, as a test wants it on the wire.
type cannedLink struct {
	answer func(h Header) string
	mu     sync.Mutex
	notify func([]byte)
	done   chan struct{}
}

func (l *cannedLink) MTU() int                                     { return 247 }
func (l *cannedLink) Read(context.Context, string) ([]byte, error) { return nil, ErrDisconnected }
func (l *cannedLink) Done() <-chan struct{}                        { return l.done }
func (l *cannedLink) Close() error                                 { return nil }
func (l *cannedLink) Subscribe(_ context.Context, _ string, fn func([]byte)) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.notify = fn
	return nil
}

func (l *cannedLink) Write(_ context.Context, _ string, data []byte, _ bool) error {
	h, err := ParseHeader(data)
	if err != nil {
		return err
	}
	body, err := hex.DecodeString(l.answer(h))
	if err != nil {
		return err
	}
	h.Op++
	h.Len = uint16(len(body))
	l.mu.Lock()
	defer l.mu.Unlock()
	go l.notify(append(AppendHeader(nil, h), body...))
	return nil
}

// Zephyr's MCUmgr encodes its answers with zcbor, which writes every map
// and array with indefinite length (0xbf … 0xff, 0x9f … 0xff) unless the
// firmware sets CONFIG_ZCBOR_CANONICAL, off by default: smp.c opens the
// answer's map with zcbor_map_start_encode, img_mgmt_state.c its list of
// slots with zcbor_list_start_encode. The bridge must read them.
func TestZephyrIndefiniteLengthAnswers(t *testing.T) {
	hash := strings.Repeat("ab", 32)
	answers := map[uint16]string{
		// {"buf_size": 2475, "buf_count": 4}
		GroupOS: "bf" + "686275665f73697a65" + "1909ab" + "696275665f636f756e74" + "04" + "ff",
		// {"images": [{"slot": 0, "version": "1.2.3.4", "hash": …, "bootable": true, "pending": false,
		// "confirmed": true, "active": true, "permanent": false}], "splitStatus": 0}
		GroupImage: "bf" + "66696d61676573" + "9f" + "bf" +
			"64736c6f74" + "00" + "6776657273696f6e" + "67312e322e332e34" + "6468617368" + "5820" + hash +
			"68626f6f7461626c65" + "f5" + "6770656e64696e67" + "f4" + "69636f6e6669726d6564" + "f5" +
			"66616374697665" + "f5" + "697065726d616e656e74" + "f4" + "ff" + "ff" +
			"6b73706c6974537461747573" + "00" + "ff",
		// {"err": {"group": 3, "rc": 3}}: version 2, a setting not found
		GroupSettings: "bf" + "63657272" + "bf" + "6567726f7570" + "03" + "627263" + "03" + "ff" + "ff",
		// {"rc": 8}
		GroupApps: "bf" + "627263" + "08" + "ff",
	}
	link := &cannedLink{answer: func(h Header) string { return answers[h.Group] }, done: make(chan struct{})}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c := cannedClient(t, ctx, link, ClientOptions{RequestTimeout: 2 * time.Second})

	p, err := c.Params(ctx)
	if err != nil || p.BufSize != 2475 || p.BufCount != 4 {
		t.Errorf("Params() = %+v, %v; want buf_size 2475, buf_count 4", p, err)
	}
	var st ImageStateResponse
	err = c.Do(ctx, OpRead, GroupImage, CmdImageState, nil, &st)
	if err != nil || len(st.Images) != 1 || !st.Images[0].Active || !st.Images[0].Confirmed || hex.EncodeToString(st.Images[0].Hash) != hash {
		t.Errorf("image state = %+v, %v", st, err)
	} else if v, err := runningVersion(st); err != nil || v != "1.2.3+4" {
		t.Errorf("runningVersion = %q, %v; want 1.2.3+4", v, err)
	}
	var e *Error
	err = c.Do(ctx, OpRead, GroupSettings, CmdSettingsValue, SettingReadRequest{Name: "companion/x"}, nil)
	if !errors.As(err, &e) || e.Group != GroupSettings || e.GroupRC != SettingsErrKeyNotFound {
		t.Errorf("setting read = %v; want the settings group's error 3", err)
	}
	err = c.Do(ctx, OpRead, GroupApps, CmdAppsList, nil, nil)
	if !errors.As(err, &e) || e.RC != RCNotSupported {
		t.Errorf("apps list = %v; want rc 8", err)
	}
}

// rawLink answers every SMP request with the notifications raw gives it.
type rawLink struct {
	cannedLink
	raw func(h Header) [][]byte
}

func (l *rawLink) Write(_ context.Context, _ string, data []byte, _ bool) error {
	h, err := ParseHeader(data)
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	notify := l.notify
	go func() {
		for _, n := range l.raw(h) {
			notify(n)
		}
	}()
	return nil
}

// A response whose header claims more than the client takes has no
// framing the client can follow: the requests in flight fail at once with
// ErrFraming, and the client gives the link up, rather than wait for their
// timeout.
func TestResponseTooLongLosesTheFraming(t *testing.T) {
	link := &rawLink{cannedLink: cannedLink{done: make(chan struct{})}, raw: func(h Header) [][]byte {
		h.Op++
		h.Len = 0xffff
		return [][]byte{AppendHeader(nil, h)}
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c := cannedClient(t, ctx, link, ClientOptions{RequestTimeout: 2 * time.Second, MaxResponse: 1024})
	// ErrFraming, not the request's timeout: the error tells the two
	// apart, with no bound on the time that a loaded machine could break.
	if _, err := c.Params(ctx); !errors.Is(err, ErrFraming) || !IsDisconnect(err) {
		t.Errorf("Params answered by a header of 65535 bytes = %v; want ErrFraming, a disconnect", err)
	}
	select {
	case <-c.Done():
	default:
		t.Error("the client still takes requests")
	}
}

// A nil byte string, array or map goes out empty, never as CBOR null,
// which zcbor's decoders refuse: a request built with no data still says
// data is an empty byte string (docs/gatt.md).
func TestNilContainersGoOutEmpty(t *testing.T) {
	b, err := EncodeBody(struct {
		Data []byte         `cbor:"data"`
		List []string       `cbor:"list"`
		Map  map[string]int `cbor:"map"`
	}{})
	if err != nil {
		t.Fatal(err)
	}
	// {"data": h'', "list": [], "map": {}}, keys in core deterministic order.
	want := []byte{0xa3, 0x63, 'm', 'a', 'p', 0xa0, 0x64, 'd', 'a', 't', 'a', 0x40, 0x64, 'l', 'i', 's', 't', 0x80}
	if !bytes.Equal(b, want) {
		t.Errorf("encoded % x; want % x", b, want)
	}
}
