package gatt

import (
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"

	"github.com/fxamacker/cbor/v2"
)

// SMP operations (the low three bits of the header's first byte).
const (
	OpRead     uint8 = 0
	OpReadRsp  uint8 = 1
	OpWrite    uint8 = 2
	OpWriteRsp uint8 = 3
)

// HeaderSize is the size of an SMP header.
const HeaderSize = 8

// MaxMessage is the largest SMP message the header's 16-bit length allows.
const MaxMessage = HeaderSize + 0xffff

// SMP versions, as the header's bits 3–4 carry them. Version 2 answers a
// group's own error as {"err": {"group", "rc"}} where version 1 has one rc
// of MCUmgr's; a device answers in the version of the request.
const (
	SMPv1 uint8 = 0
	SMPv2 uint8 = 1
)

// Groups and command ids of the profile (docs/gatt.md). Groups below 64 are
// MCUmgr's, with the commands Zephyr's os_mgmt, img_mgmt and settings_mgmt
// give them; 64 and up are the project's own.
const (
	GroupOS             uint16 = 0
	GroupImage          uint16 = 1
	GroupSettings       uint16 = 3
	GroupText           uint16 = 64
	GroupPush           uint16 = 65 // image push: the chunked upload of a picture to show
	GroupApps           uint16 = 66
	GroupSettingsSchema uint16 = 67 // the names and kinds of the settings that group 3 reads and writes

	CmdOSEcho   uint8 = 0
	CmdOSReset  uint8 = 5
	CmdOSParams uint8 = 6 // MCUmgr parameters: buf_size, buf_count

	CmdImageState  uint8 = 0 // read: the slots; write: test or confirm an image
	CmdImageUpload uint8 = 1

	CmdSettingsValue  uint8 = 0 // read {name} → {val}; write {name, val}
	CmdSettingsDelete uint8 = 1
	CmdSettingsCommit uint8 = 2
	CmdSettingsSave   uint8 = 3 // write: save; read: load

	CmdSchemaRead uint8 = 0

	CmdTextPush   uint8 = 0
	CmdTextUpload uint8 = 1 // a text too long for one request, as a chunked upload

	CmdPushUpload uint8 = 1

	CmdAppsList      uint8 = 0
	CmdAppsInstall   uint8 = 1
	CmdAppsUninstall uint8 = 2
)

// Header is the 8-byte SMP header, big-endian on the wire: op (bits 0–2)
// and SMP version (bits 3–4) in one byte, flags, length of the CBOR body
// (uint16), group (uint16), sequence, command id.
type Header struct {
	Op      uint8
	Version uint8 // SMPv1 or SMPv2
	Flags   uint8
	Len     uint16
	Group   uint16
	Seq     uint8
	ID      uint8
}

// AppendHeader appends h's 8 bytes to b.
func AppendHeader(b []byte, h Header) []byte {
	b = append(b, h.Op&7|(h.Version&3)<<3, h.Flags)
	b = binary.BigEndian.AppendUint16(b, h.Len)
	b = binary.BigEndian.AppendUint16(b, h.Group)
	return append(b, h.Seq, h.ID)
}

// ErrShortHeader is returned by ParseHeader for fewer than 8 bytes.
var ErrShortHeader = errors.New("gatt: short SMP header")

// ParseHeader reads an SMP header from the first 8 bytes of b.
func ParseHeader(b []byte) (Header, error) {
	if len(b) < HeaderSize {
		return Header{}, ErrShortHeader
	}
	return Header{
		Op:      b[0] & 7,
		Version: b[0] >> 3 & 3,
		Flags:   b[1],
		Len:     binary.BigEndian.Uint16(b[2:4]),
		Group:   binary.BigEndian.Uint16(b[4:6]),
		Seq:     b[6],
		ID:      b[7],
	}, nil
}

// Message is one SMP message: its header and its CBOR body.
type Message struct {
	Header
	Body []byte
}

// Decoding limits: a hostile body cannot make the decoder nest deeply,
// allocate huge maps or arrays, or claim huge strings.
const (
	maxNesting    = 8
	maxPairs      = 256
	maxArrayElems = 1024
)

var (
	encMode cbor.EncMode
	decMode cbor.DecMode
)

func init() {
	var err error
	enc := cbor.CoreDetEncOptions()
	// A nil byte string, array or map goes out empty, not as null: zcbor's
	// decoders of a bstr, list or map refuse null, and the first request of
	// a project upload, with no data, has empty data (docs/gatt.md).
	enc.NilContainers = cbor.NilContainerAsEmpty
	encMode, err = enc.EncMode()
	if err != nil {
		panic(err)
	}
	decMode, err = cbor.DecOptions{
		MaxNestedLevels:  maxNesting,
		MaxMapPairs:      maxPairs,
		MaxArrayElements: maxArrayElems,
		// Byte and text strings can be no longer than the message that
		// carries them, which the reassembler has bounded already.
		DupMapKey: cbor.DupMapKeyEnforcedAPF,
		// Zephyr's zcbor writes every map and array with indefinite
		// length unless the firmware sets CONFIG_ZCBOR_CANONICAL (off by
		// default): a stock device answers nothing else. The limits above
		// hold for them too.
		IndefLength:    cbor.IndefLengthAllowed,
		DefaultMapType: reflect.TypeFor[map[string]any](),
	}.DecMode()
	if err != nil {
		panic(err)
	}
}

// EncodeBody encodes v as an SMP body (deterministic CBOR).
func EncodeBody(v any) ([]byte, error) { return encMode.Marshal(v) }

// DecodeBody decodes an SMP body into v, within the decoding limits.
func DecodeBody(body []byte, v any) error {
	if len(body) == 0 {
		body = []byte{0xa0} // an empty body is an empty map
	}
	return decMode.Unmarshal(body, v)
}

// EncodeMessage builds a whole SMP message of version SMPv2: header then
// CBOR of body.
func EncodeMessage(op uint8, group uint16, seq, id uint8, body any) ([]byte, error) {
	b, err := EncodeBody(body)
	if err != nil {
		return nil, err
	}
	if len(b) > 0xffff {
		return nil, fmt.Errorf("gatt: SMP body of %d bytes is too long", len(b))
	}
	out := make([]byte, 0, HeaderSize+len(b))
	out = AppendHeader(out, Header{Op: op, Version: SMPv2, Len: uint16(len(b)), Group: group, Seq: seq, ID: id})
	return append(out, b...), nil
}

// ErrTooLong is returned by a Reassembler for a message longer than its
// limit.
var ErrTooLong = errors.New("gatt: SMP message longer than the buffer")

// Reassembler joins the fragments of a stream (ATT writes or notifications,
// each at most MTU-3 bytes) into whole SMP messages by the header's length.
// A fragment may end one message and start the next. It is not safe for
// concurrent use.
type Reassembler struct {
	max int // largest whole message, header included
	buf []byte
}

// NewReassembler returns a reassembler that rejects messages longer than limit
// bytes (header included). limit is clamped to 8…MaxMessage.
func NewReassembler(limit int) *Reassembler {
	return &Reassembler{max: min(max(limit, HeaderSize), MaxMessage)}
}

// Feed adds a fragment and returns the messages it completed. After an
// error the reassembler has dropped what it held and starts afresh with
// the next fragment: a stream that lost its framing is not trusted.
func (r *Reassembler) Feed(frag []byte) ([]Message, error) {
	r.buf = append(r.buf, frag...)
	var out []Message
	for len(r.buf) >= HeaderSize {
		h, _ := ParseHeader(r.buf)
		total := HeaderSize + int(h.Len)
		if total > r.max {
			r.Reset()
			return out, fmt.Errorf("%w: %d > %d bytes", ErrTooLong, total, r.max)
		}
		if len(r.buf) < total {
			break
		}
		body := make([]byte, h.Len)
		copy(body, r.buf[HeaderSize:total])
		out = append(out, Message{Header: h, Body: body})
		r.buf = r.buf[total:]
	}
	if len(r.buf) == 0 {
		r.buf = nil // let a finished message's array go
	}
	return out, nil
}

// Pending reports how many bytes of an unfinished message it holds.
func (r *Reassembler) Pending() int { return len(r.buf) }

// Reset drops a partial message (after a disconnect).
func (r *Reassembler) Reset() { r.buf = nil }
