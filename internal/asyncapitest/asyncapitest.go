// Package asyncapitest checks MQTT messages against docs/asyncapi.yaml, the
// document of the topics and payloads of CONTRACT §3: it finds the channel
// whose address a topic matches and validates the payload against that
// channel's message schema (JSON Schema draft 7, as AsyncAPI 3's default
// schema format is a superset of it), with formats such as date-time
// asserted.
//
// It is for tests only; nothing outside _test.go files should import it. It
// reads only what the validation needs of the document (channels, their
// messages and payloads, the MQTT operation bindings' retain flag); it is
// not an AsyncAPI parser.
package asyncapitest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"go.yaml.in/yaml/v3"

	"github.com/devicecompanion/companion/internal/testenv"
)

// Path is where the document lives, relative to the repository's root.
const Path = "docs/asyncapi.yaml"

// docURL names the document inside the schema compiler.
const docURL = "urn:companion:asyncapi"

// Doc is a loaded document: its channels with their compiled payload
// schemas.
type Doc struct {
	channels []*channel
	servers  []string
}

type channel struct {
	name     string
	address  string
	re       *regexp.Regexp
	retained bool // some operation on the channel publishes it retained
	messages []messageSchema
}

// messageSchema is one message of a channel: its compiled payload schema,
// and whether the payload is text/plain (validated as one JSON string:
// an empty retained message, which clears the topic, is the empty string)
// rather than JSON.
type messageSchema struct {
	text   bool
	schema *jsonschema.Schema
}

// Load reads and compiles the repository's docs/asyncapi.yaml, failing tb
// if it cannot.
func Load(tb testing.TB) *Doc {
	tb.Helper()
	d, err := Parse(testenv.ReadRepoFile(tb, Path))
	if err != nil {
		tb.Fatalf("%s: %v", Path, err)
	}
	return d
}

// Parse compiles an AsyncAPI 3 document given as YAML (or JSON).
func Parse(yamlDoc []byte) (*Doc, error) {
	var raw any
	if err := yaml.Unmarshal(yamlDoc, &raw); err != nil {
		return nil, err
	}
	// Through encoding/json: the schema library takes what it produces.
	js, err := json.Marshal(raw)
	if err != nil {
		return nil, fmt.Errorf("not JSON-compatible: %w", err)
	}
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(js))
	if err != nil {
		return nil, err
	}
	var doc struct {
		AsyncAPI           string `json:"asyncapi"`
		DefaultContentType string `json:"defaultContentType"`
		Servers            map[string]struct {
			Protocol string `json:"protocol"`
		} `json:"servers"`
		Channels map[string]struct {
			Address  string                     `json:"address"`
			Messages map[string]json.RawMessage `json:"messages"`
		} `json:"channels"`
		Operations map[string]struct {
			Channel  ref `json:"channel"`
			Bindings struct {
				Ref  string `json:"$ref"`
				MQTT *struct {
					Retain bool `json:"retain"`
				} `json:"mqtt"`
			} `json:"bindings"`
		} `json:"operations"`
		Components struct {
			Messages          map[string]message `json:"messages"`
			OperationBindings map[string]struct {
				MQTT *struct {
					Retain bool `json:"retain"`
				} `json:"mqtt"`
			} `json:"operationBindings"`
		} `json:"components"`
	}
	if err := json.Unmarshal(js, &doc); err != nil {
		return nil, err
	}
	if !strings.HasPrefix(doc.AsyncAPI, "3.") {
		return nil, fmt.Errorf("asyncapi %q: want 3.x", doc.AsyncAPI)
	}

	c := jsonschema.NewCompiler()
	c.DefaultDraft(jsonschema.Draft7)
	c.AssertFormat()
	if err := c.AddResource(docURL, inst); err != nil {
		return nil, err
	}

	d := &Doc{}
	byName := map[string]*channel{}
	for name, ch := range doc.Channels {
		if ch.Address == "" {
			return nil, fmt.Errorf("channel %s has no address", name)
		}
		re, err := addressPattern(ch.Address)
		if err != nil {
			return nil, fmt.Errorf("channel %s: %w", name, err)
		}
		cc := &channel{name: name, address: ch.Address, re: re}
		if len(ch.Messages) == 0 {
			return nil, fmt.Errorf("channel %s has no messages", name)
		}
		for mname, rawMsg := range ch.Messages {
			var m message
			if err := json.Unmarshal(rawMsg, &m); err != nil {
				return nil, fmt.Errorf("channel %s message %s: %w", name, mname, err)
			}
			loc := "#/channels/" + pointerEscape(name) + "/messages/" + pointerEscape(mname)
			if m.Ref != "" {
				key, ok := strings.CutPrefix(m.Ref, "#/components/messages/")
				if !ok {
					return nil, fmt.Errorf("channel %s message %s: $ref %q is not to #/components/messages/", name, mname, m.Ref)
				}
				target, found := doc.Components.Messages[key]
				if !found {
					return nil, fmt.Errorf("channel %s message %s: $ref %q names no message", name, mname, m.Ref)
				}
				m, loc = target, m.Ref
			}
			if len(m.Payload) == 0 {
				return nil, fmt.Errorf("channel %s message %s has no payload schema", name, mname)
			}
			contentType := m.ContentType
			if contentType == "" {
				contentType = doc.DefaultContentType
			}
			text := false
			switch contentType {
			case "application/json":
			case "text/plain":
				text = true
			default:
				return nil, fmt.Errorf("channel %s message %s: content type %q", name, mname, contentType)
			}
			s, err := c.Compile(docURL + loc + "/payload")
			if err != nil {
				return nil, fmt.Errorf("channel %s message %s: %w", name, mname, err)
			}
			cc.messages = append(cc.messages, messageSchema{text: text, schema: s})
		}
		byName[name] = cc
		d.channels = append(d.channels, cc)
	}
	for oname, op := range doc.Operations {
		name, ok := strings.CutPrefix(op.Channel.Ref, "#/channels/")
		if !ok || byName[name] == nil {
			return nil, fmt.Errorf("operation %s: channel $ref %q names no channel", oname, op.Channel.Ref)
		}
		mq := op.Bindings.MQTT
		if r, ok := strings.CutPrefix(op.Bindings.Ref, "#/components/operationBindings/"); ok {
			mq = doc.Components.OperationBindings[r].MQTT
		}
		if mq == nil {
			return nil, fmt.Errorf("operation %s has no MQTT binding", oname)
		}
		byName[name].retained = byName[name].retained || mq.Retain
	}
	sort.Slice(d.channels, func(i, j int) bool { return d.channels[i].name < d.channels[j].name })
	for name, srv := range doc.Servers {
		if srv.Protocol != "mqtt" {
			return nil, fmt.Errorf("server %s: protocol %q, not mqtt", name, srv.Protocol)
		}
		d.servers = append(d.servers, name)
	}
	sort.Strings(d.servers)
	return d, nil
}

type ref struct {
	Ref string `json:"$ref"`
}

type message struct {
	Ref         string          `json:"$ref"`
	ContentType string          `json:"contentType"`
	Payload     json.RawMessage `json:"payload"`
}

// addressPattern turns a channel address with {parameters} into a regexp
// matching the topic names it stands for: a parameter is one topic level.
func addressPattern(address string) (*regexp.Regexp, error) {
	var b strings.Builder
	b.WriteString("^")
	rest := address
	for {
		i := strings.IndexByte(rest, '{')
		if i < 0 {
			b.WriteString(regexp.QuoteMeta(rest))
			break
		}
		j := strings.IndexByte(rest[i:], '}')
		if j < 0 {
			return nil, fmt.Errorf("address %q: unclosed {", address)
		}
		b.WriteString(regexp.QuoteMeta(rest[:i]))
		b.WriteString("[^/+#]+")
		rest = rest[i+j+1:]
	}
	b.WriteString("$")
	return regexp.Compile(b.String())
}

func pointerEscape(s string) string {
	return strings.ReplaceAll(strings.ReplaceAll(s, "~", "~0"), "/", "~1")
}

// Servers returns the names of the document's servers (the brokers it
// says carry the topics), sorted.
func (d *Doc) Servers() []string { return slices.Clone(d.servers) }

// ErrNoChannel is returned for a topic no channel's address matches.
var ErrNoChannel = errors.New("asyncapitest: no channel of the document matches the topic")

// Channels returns the names of the document's channels, sorted.
func (d *Doc) Channels() []string {
	names := make([]string, len(d.channels))
	for i, c := range d.channels {
		names[i] = c.name
	}
	return names
}

// Validate finds the channel of topic and checks payload against its
// message schemas (one must accept it). retained says the message came
// with the MQTT retain flag; it is an error on a channel the document
// does not publish retained. It returns the channel's name.
func (d *Doc) Validate(topic string, payload []byte, retained bool) (string, error) {
	var ch *channel
	for _, c := range d.channels {
		if c.re.MatchString(topic) {
			ch = c
			break
		}
	}
	if ch == nil {
		return "", fmt.Errorf("%w: %s", ErrNoChannel, topic)
	}
	if retained && !ch.retained {
		return ch.name, fmt.Errorf("%s: a retained message on channel %s, which the document says is not retained", topic, ch.name)
	}
	// Each message by its own content type: a channel of JSON messages may
	// also have a text/plain one (the empty payload that clears a retained
	// message).
	var errs []error
	for _, m := range ch.messages {
		var inst any = string(payload)
		if !m.text {
			var err error
			if inst, err = jsonschema.UnmarshalJSON(bytes.NewReader(payload)); err != nil {
				errs = append(errs, fmt.Errorf("payload is not JSON: %v", err))
				continue
			}
		}
		err := m.schema.Validate(inst)
		if err == nil {
			return ch.name, nil
		}
		var ve *jsonschema.ValidationError
		if errors.As(err, &ve) {
			err = fmt.Errorf("%#v", ve) // every failed keyword, not only the first line
		}
		errs = append(errs, err)
	}
	return ch.name, fmt.Errorf("%s (channel %s): payload %s does not match the document: %w", topic, ch.name, payload, errors.Join(errs...))
}
