package natsauth

import (
	"fmt"
	"strings"
)

// Subjects returns the NATS subjects that NATS Server's MQTT checks an MQTT
// topic name or filter against: levels become tokens, "+" "*", "#" ">", a
// "." inside a level "//"; a filter ending in "#" gives its parent too,
// which NATS subscribes to as well (MQTT's "a/#" matches "a"). Empty
// levels (which NATS maps in ways rights should not rely on) and "$MQTT"
// topics (NATS's own, which MQTT clients may not use) are refused.
func Subjects(filter string) ([]string, error) {
	if filter == "" || strings.HasPrefix(filter, "$MQTT") {
		return nil, fmt.Errorf("natsauth: topic filter %q: empty or a $MQTT topic", filter)
	}
	levels := strings.Split(filter, "/")
	toks := make([]string, len(levels))
	for i, l := range levels {
		switch {
		case l == "":
			return nil, fmt.Errorf("natsauth: topic filter %q: empty level", filter)
		case l == "+":
			toks[i] = "*"
		case l == "#":
			if i != len(levels)-1 {
				return nil, fmt.Errorf("natsauth: topic filter %q: # not last", filter)
			}
			toks[i] = ">"
		case strings.ContainsAny(l, "+#"):
			return nil, fmt.Errorf("natsauth: topic filter %q: wildcard inside a level", filter)
		case strings.ContainsAny(l, " \t\r\n\f*>\x7f"):
			return nil, fmt.Errorf("natsauth: topic filter %q: a character NATS does not take", filter)
		default:
			toks[i] = strings.ReplaceAll(l, ".", "//")
		}
	}
	out := []string{strings.Join(toks, ".")}
	if len(toks) > 1 && toks[len(toks)-1] == ">" {
		out = append(out, strings.Join(toks[:len(toks)-1], "."))
	}
	return out, nil
}
