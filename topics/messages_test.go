package topics

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/devicecompanion/companion"
)

func TestFinalAndRank(t *testing.T) {
	for _, s := range companion.States {
		final := s == companion.StateSucceeded || s == companion.StateFailed || s == companion.StateExpired || s == companion.StateCanceled
		if companion.IsFinal(s) != final {
			t.Errorf("Final(%q) = %v; want %v", s, companion.IsFinal(s), final)
		}
	}
	order := []string{companion.StateQueued, companion.StateSent, companion.StateDelivered, companion.StateInProgress, companion.StateSucceeded}
	for i := 1; i < len(order); i++ {
		if companion.Rank(order[i-1]) >= companion.Rank(order[i]) {
			t.Errorf("Rank(%q) >= Rank(%q)", order[i-1], order[i])
		}
	}
	if companion.Rank("bogus") != -1 {
		t.Errorf("Rank(bogus) = %d; want -1", companion.Rank("bogus"))
	}
}

func TestParseReply(t *testing.T) {
	id := "01890a5d-ac96-774b-bcce-b302099a8057"
	ok := []string{
		`{"command_id":"` + id + `","state":"delivered","at":"2026-01-01T00:00:00Z"}`,
		`{"command_id":"` + id + `","state":"in_progress","progress":50}`,
		`{"command_id":"` + id + `","state":"failed","error":{"code":"x","message":"y"}}`,
		`{"command_id":"` + id + `","state":"succeeded","status":{"online":true,"battery":80,"firmware_version":"1.0.0","apps":[{"app_id":"clock","version":"1.0.0"}],"bridge_id":"b1","at":"2026-01-01T00:00:00Z","seq":7}}`,
		`{"command_id":"` + id + `","state":"succeeded","settings":{"reported":{"volume":70},"schema":{},"seq":8}}`,
		// An `at` that is no time is taken as none, in BadAt (bug 425).
		`{"command_id":"` + id + `","state":"delivered","at":"yesterday"}`,
	}
	for _, in := range ok {
		if _, err := ParseReply([]byte(in)); err != nil {
			t.Errorf("ParseReply(%s) = %v; want nil", in, err)
		}
	}
	bad := []string{
		``, `null`, `[]`, `{"command_id":"x","state":"delivered"}`,
		`{"command_id":"` + id + `","state":"queued"}`,
		`{"command_id":"` + id + `","state":"sent"}`,
		`{"command_id":"` + id + `","state":"nope"}`,
		`{"command_id":"` + id + `","state":"in_progress","progress":101}`,
		`{"command_id":"` + id + `","state":"in_progress","progress":-1}`,
		`{"command_id":"` + id + `","state":"delivered","x":"` + strings.Repeat("a", MaxPayload) + `"}`,
		// The device's state comes with a final reply only, and is checked
		// as its own message is.
		`{"command_id":"` + id + `","state":"in_progress","progress":5,"status":{"online":true,"apps":[]}}`,
		`{"command_id":"` + id + `","state":"succeeded","status":{"online":true,"battery":101,"apps":[]}}`,
		`{"command_id":"` + id + `","state":"succeeded","status":{"online":true,"apps":[{"app_id":"Bad App"}]}}`,
		`{"command_id":"` + id + `","state":"succeeded","settings":{"schema":{}}}`,
	}
	for _, in := range bad {
		if _, err := ParseReply([]byte(in)); !errors.Is(err, ErrBadMessage) {
			t.Errorf("ParseReply(%.60s) = %v; want ErrBadMessage", in, err)
		}
	}
}

func TestParseStatusAndCommand(t *testing.T) {
	if _, err := ParseStatus([]byte(`{"online":true,"battery":80,"apps":[{"app_id":"weather","version":"1.0.0"}],"seq":3}`)); err != nil {
		t.Errorf("ParseStatus(good) = %v", err)
	}
	for _, in := range []string{`{"battery":101}`, `{"battery":-1}`, `{"apps":[{"app_id":"Bad/Id"}]}`, `{"bridge_id":"a/b"}`, `{`} {
		if _, err := ParseStatus([]byte(in)); !errors.Is(err, ErrBadMessage) {
			t.Errorf("ParseStatus(%s) = %v; want ErrBadMessage", in, err)
		}
	}
	id := "01890a5d-ac96-774b-bcce-b302099a8057"
	if _, err := ParseCommand([]byte(`{"id":"` + id + `","op":"push.text","device_id":"d1","payload":{"text":"hi"}}`)); err != nil {
		t.Errorf("ParseCommand(good) = %v", err)
	}
	for _, in := range []string{
		`{"id":"nope","op":"push.text","device_id":"d1"}`,
		`{"id":"` + id + `","op":"rm","device_id":"d1"}`,
		`{"id":"` + id + `","op":"push.text","device_id":"d/1"}`,
	} {
		if _, err := ParseCommand([]byte(in)); !errors.Is(err, ErrBadMessage) {
			t.Errorf("ParseCommand(%s) = %v; want ErrBadMessage", in, err)
		}
	}
	if _, err := ParseSettings([]byte(`{"schema":{}}`)); !errors.Is(err, ErrBadMessage) {
		t.Errorf("ParseSettings without reported = %v; want ErrBadMessage", err)
	}
}

func FuzzParseMessages(f *testing.F) {
	f.Add([]byte(`{"command_id":"01890a5d-ac96-774b-bcce-b302099a8057","state":"delivered"}`))
	f.Add([]byte(`{"online":true,"battery":5,"seq":1}`))
	f.Add([]byte(`{"reported":{"a":1},"schema":{}}`))
	f.Add([]byte(`{"reported":{"":1,"a":null,"b":1e999,"c":"x","d":[1]},"schema":{"c":{"type":"enum","values":["x","x",""]},"\t":{"type":"int"}}}`))
	f.Add([]byte(`{"id":"01890a5d-ac96-774b-bcce-b302099a8057","op":"push.text","device_id":"d1","payload":{"text":"hi"}}`))
	f.Add([]byte(`{"command_id":"01890a5d-ac96-774b-bcce-b302099a8057","state":"succeeded","at":"2026-01-02T03:04:05+01:00",` +
		`"status":{"online":true,"firmware_version":"1.0.0\u0000","apps":[{"app_id":"a","version":"1"}],"seq":2},"settings":{"reported":{"x":1}}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		// What a parser accepts, written again as a bridge or the server
		// writes it, is accepted again and reads the same: nothing is
		// taken that the other side of the topic could not send.
		again := func(name string, v any, parse func([]byte) (any, error)) {
			out, err := json.Marshal(v)
			if err != nil {
				t.Fatalf("%s accepted %q as %+v, which does not encode: %v", name, b, v, err)
			}
			w, err := parse(out)
			if err != nil {
				t.Fatalf("%s accepted %q; written again as %s it is refused: %v", name, b, out, err)
			}
			if out2, _ := json.Marshal(w); string(out2) != string(out) {
				t.Fatalf("%s accepted %q; written again %s, then %s", name, b, out, out2)
			}
		}
		if r, err := ParseReply(b); err == nil {
			again("ParseReply", r, func(b []byte) (any, error) { return ParseReply(b) })
		}
		if s, err := ParseStatus(b); err == nil {
			again("ParseStatus", s, func(b []byte) (any, error) { return ParseStatus(b) })
		}
		if s, err := ParseSettings(b); err == nil {
			again("ParseSettings", s, func(b []byte) (any, error) { return ParseSettings(b) })
		}
		if c, err := ParseCommand(b); err == nil {
			again("ParseCommand", c, func(b []byte) (any, error) { return ParseCommand(b) })
		}
	})
}

// An error is why a command failed, expired or was canceled: a bridge's
// reply of another state with one is taken without it. The server keeps a
// command's error through its later states, so an in_progress reply with
// an error made the command read succeeded with that error (bug 146).
func TestAnErrorOnlyWithAFailure(t *testing.T) {
	const id = "0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
	for _, state := range companion.States {
		if state == companion.StateQueued || state == companion.StateSent {
			continue
		}
		r, err := ParseReply([]byte(`{"command_id":"` + id + `","state":"` + state + `","error":{"code":"device_error","message":"x"}}`))
		if err != nil {
			t.Fatalf("%s: %v", state, err)
		}
		failure := state == companion.StateFailed || state == companion.StateExpired || state == companion.StateCanceled
		if (r.Error != nil) != failure {
			t.Errorf("a %s reply with an error is taken with error %+v; want one only for failed, expired and canceled", state, r.Error)
		}
	}
}

// Text a device reported reaches every store: a C string's terminator is
// dropped, a NUL inside one is replaced (PostgreSQL's text cannot hold it).
func TestDeviceTextLosesItsNULs(t *testing.T) {
	const id = "0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
	r, err := ParseReply([]byte(`{"command_id":"` + id + `","state":"failed","error":{"code":"smp\u0000","message":"rc 3\u0000 bad\u0000\u0000"},
		"status":{"online":true,"firmware_version":"1.0.0\u0000","model":"sim-1\u0000","apps":[{"app_id":"weather","version":"1.2.0\u0000"}],"bridge_id":"b1","seq":1}}`))
	if err != nil {
		t.Fatal(err)
	}
	if r.Error.Code != "smp" || r.Error.Message != "rc 3\uFFFD bad" {
		t.Errorf("error = %q, %q; want \"smp\", \"rc 3\\uFFFD bad\"", r.Error.Code, r.Error.Message)
	}
	if st := r.Status; st.Model != "sim-1" || st.FirmwareVersion != "1.0.0" || st.Apps[0].Version != "1.2.0" {
		t.Errorf("status = %+v; want its text without NULs", *st)
	}
	s, err := ParseStatus([]byte(`{"online":true,"firmware_version":"\u00001.0","model":"sim\u0000-1","apps":[],"bridge_id":"b1","seq":1}`))
	if err != nil {
		t.Fatal(err)
	}
	if s.Model != "sim\uFFFD-1" || s.FirmwareVersion != "\uFFFD1.0" {
		t.Errorf("status = %q, %q", s.Model, s.FirmwareVersion)
	}
}

// A model and a version a device reported are one line with no control
// character: each becomes U+FFFD, as a NUL inside one does (bug 568).
func TestDeviceLabelsHaveNoControlCharacters(t *testing.T) {
	s, err := ParseStatus([]byte(`{"online":true,"firmware_version":"1.0\n.0\u0000","model":"sim\u001b[31m-1\t",` +
		`"apps":[{"app_id":"weather","version":"1.2\u0085"}],"bridge_id":"b1","seq":1}`))
	if err != nil {
		t.Fatal(err)
	}
	if s.Model != "sim\uFFFD[31m-1\uFFFD" || s.FirmwareVersion != "1.0\uFFFD.0" || s.Apps[0].Version != "1.2\uFFFD" {
		t.Errorf("status = %q, %q, %q; want each control character U+FFFD", s.Model, s.FirmwareVersion, s.Apps[0].Version)
	}
	r, err := ParseReply([]byte(`{"command_id":"0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b","state":"succeeded",` +
		`"status":{"online":true,"firmware_version":"2.0.0","model":"acme\r\nX-Injected: 1","apps":[],"bridge_id":"b1","seq":2}}`))
	if err != nil {
		t.Fatal(err)
	}
	if r.Status.Model != "acme\uFFFD\uFFFDX-Injected: 1" {
		t.Errorf("a reply's status model = %q; want its line breaks U+FFFD", r.Status.Model)
	}
}

// An error of another JSON type than the contract's is taken as far as it
// says something, and the reply with it (bug 571): it was dropped as
// malformed, and the command it ended never ended.
func TestAnErrorOfAnotherJSONTypeIsTaken(t *testing.T) {
	const id = "0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
	for _, c := range []struct {
		error                  string
		code, message, badCode string
	}{
		{`{"code":"device_busy","message":"busy"}`, "device_busy", "busy", ""},
		{`{"code":5,"message":"rc 5"}`, "", "rc 5", "5"},
		{`{"code":{"rc":3},"message":"rc 3"}`, "", "rc 3", `{"rc":3}`},
		{`{"code":"device_busy","message":{"rc":3}}`, "device_busy", `{"rc":3}`, ""},
		{`{"code":null,"message":null}`, "", "", ""},
		{`{"message":7}`, "", "7", ""},
		{`"the disk is on fire"`, "", "the disk is on fire", ""},
		{`[1,2]`, "", "[1,2]", ""},
		{`{"code":"` + strings.Repeat("x", 70) + `"}`, "", "", strings.Repeat("x", 64) + "…"},
		{`{"code":` + strings.Repeat("9", 70) + `}`, "", "", strings.Repeat("9", 64) + "…"},
	} {
		r, err := ParseReply([]byte(`{"command_id":"` + id + `","state":"failed","error":` + c.error + `}`))
		if err != nil {
			t.Errorf("a reply with the error %s: %v; want it taken", c.error, err)
			continue
		}
		if r.Error == nil || r.Error.Code != c.code || r.Error.Message != c.message || r.Error.BadCode != c.badCode {
			t.Errorf("the error %s reads %+v; want code %q, message %q, bad code %q", c.error, r.Error, c.code, c.message, c.badCode)
		}
	}
	long := strings.Repeat("7", 2*MaxErrorMessage)
	r, err := ParseReply([]byte(`{"command_id":"` + id + `","state":"failed","error":{"message":` + long + `}}`))
	if err != nil || len(r.Error.Message) > MaxErrorMessage+len("…") {
		t.Errorf("a message of %d digits: %v, %d bytes kept; want at most %d", len(long), err, len(r.Error.Message), MaxErrorMessage)
	}
}

// An error code not of the contract's form (^[a-z0-9_]+$, at most
// MaxErrorCode bytes) is taken as no code, kept in BadCode, cut to its
// bound; the reply is taken (docs/reliability.md, bug 569).
func TestAnErrorCodeOfAnotherFormIsSetAside(t *testing.T) {
	const id = "0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
	long := strings.Repeat("a", 10<<10)
	for _, c := range []struct{ code, want, bad string }{
		{"device_unreachable", "device_unreachable", ""},
		{"timeout", "timeout", ""},
		{"e2big_0", "e2big_0", ""},
		{strings.Repeat("z", MaxErrorCode), strings.Repeat("z", MaxErrorCode), ""},
		{"smp\u0000", "smp", ""}, // a C string's terminator goes first (deviceText)
		{"", "", ""},             // no code (bug 555)
		{"Bad Code!", "", "Bad Code!"},
		{"device error", "", "device error"},
		{"TIMEOUT", "", "TIMEOUT"},
		{"Timeout", "", "Timeout"},
		{"time-out", "", "time-out"},
		{"time\nout", "", "time\nout"},
		{"\u0007", "", "\u0007"},
		{" timeout", "", " timeout"},
		{"tímeout", "", "tímeout"},
		{strings.Repeat("z", MaxErrorCode+1), "", strings.Repeat("z", MaxErrorCode) + "…"},
		{long, "", long[:MaxErrorCode] + "…"},
		// Cut on a character's boundary: é is two bytes, the 64th its first.
		{strings.Repeat("a", MaxErrorCode-1) + "éé", "", strings.Repeat("a", MaxErrorCode-1) + "…"},
	} {
		code, err := json.Marshal(c.code)
		if err != nil {
			t.Fatal(err)
		}
		r, err := ParseReply([]byte(`{"command_id":"` + id + `","state":"failed","error":{"code":` + string(code) + `,"message":"m"}}`))
		if err != nil {
			t.Errorf("ParseReply with the code %.80q = %v; want nil", c.code, err)
			continue
		}
		if r.Error == nil || r.Error.Code != c.want || r.Error.BadCode != c.bad || r.Error.Message != "m" {
			t.Errorf("ParseReply with the code %.80q: error %+.80v; want code %q, BadCode %.80q, message \"m\"", c.code, r.Error, c.want, c.bad)
		}
	}
	for _, c := range []struct {
		code string
		want bool
	}{
		{"timeout", true}, {"a", true}, {"0", true}, {"_", true}, {strings.Repeat("x", 64), true},
		{"", false}, {strings.Repeat("x", 65), false}, {"A", false}, {"a b", false}, {"a-b", false},
		{"a.b", false}, {"a\x00", false}, {"é", false}, {"a\n", false},
	} {
		if got := ValidErrorCode(c.code); got != c.want {
			t.Errorf("ValidErrorCode(%q) = %v; want %v", c.code, got, c.want)
		}
	}
}

// BenchmarkParseReply is the server's intake of a reply, two of which
// (delivered, then final) come in for every command.
func BenchmarkParseReply(b *testing.B) {
	msg := []byte(`{"command_id":"0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b","state":"succeeded","progress":100,"at":"2026-12-01T11:30:14.123Z"}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ParseReply(msg); err != nil {
			b.Fatal(err)
		}
	}
}

// A bridge's error message is kept to MaxErrorMessage bytes, cut on a
// character's boundary with an ellipsis; it was stored and served whole,
// up to the 256 KiB of a message (bug 572).
func TestAnErrorMessageIsBounded(t *testing.T) {
	const id = "0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
	for _, c := range []struct {
		message string
		want    string
	}{
		{"rc 3", "rc 3"},
		{strings.Repeat("a", MaxErrorMessage), strings.Repeat("a", MaxErrorMessage)},
		{strings.Repeat("a", MaxErrorMessage+1), strings.Repeat("a", MaxErrorMessage) + "…"},
		{strings.Repeat("é", 100<<10), strings.Repeat("é", MaxErrorMessage/2) + "…"},
		{"x" + strings.Repeat("é", MaxErrorMessage), "x" + strings.Repeat("é", MaxErrorMessage/2-1) + "…"},
	} {
		b, err := json.Marshal(map[string]any{"command_id": id, "state": "failed", "error": map[string]string{"code": "device_error", "message": c.message}})
		if err != nil {
			t.Fatal(err)
		}
		r, err := ParseReply(b)
		if err != nil {
			t.Fatalf("a message of %d bytes: %v", len(c.message), err)
		}
		if r.Error.Message != c.want || !utf8.ValidString(r.Error.Message) {
			t.Errorf("a message of %d bytes is kept as %d bytes; want %d", len(c.message), len(r.Error.Message), len(c.want))
		}
	}
}
