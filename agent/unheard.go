package agent

import (
	"fmt"
	"time"
)

// Of commands the server sends again after the bridge finished and
// answered them (noteRepeated): a command repeated unheardRepeats times,
// the last at least unheardSpan after the first, is taken as a reply the
// server did not hear; the bridge says so at most once in hintEvery.
// repeatsKept bounds the commands noted.
const (
	unheardRepeats = 3
	unheardSpan    = time.Minute
	repeatsKept    = 1024
)

// repeatNote is what the bridge noted of a finished command sent again.
type repeatNote struct {
	n     int
	first time.Duration // since born
	told  bool          // counted as unheard already
}

// noteRepeated notes that the server sent again command id of deviceID,
// which the bridge had finished and answered (its final reply is
// republished). The server sends a command again while it reads sent,
// with no word of it from the bridge: once, a reply lost with a broker's
// crash or still on its way; a command sent again and again, over a
// minute and more, after its reply went out each time, says that the
// replies do not reach the server. A broker whose ACLs refuse the
// bridge's publish of its replies says nothing of it: Mosquitto
// acknowledges a refused QoS 1 PUBLISH and drops it, as with an acl_file
// that misses the bridge's `topic write …/replies` line. The bridge ran
// each command once, and the server held it sent until its TTL expired,
// while neither logged a word (docs/reliability.md, bug 484).
func (a *Agent) noteRepeated(deviceID, id string) {
	now := time.Since(a.born)
	a.repeatsMu.Lock()
	if a.repeats == nil {
		a.repeats = map[string]*repeatNote{}
	}
	r := a.repeats[id]
	if r == nil {
		if len(a.repeats) >= repeatsKept {
			for k, v := range a.repeats {
				if now-v.first > 10*a.unheardSpan {
					delete(a.repeats, k)
				}
			}
			if len(a.repeats) >= repeatsKept {
				clear(a.repeats)
			}
		}
		r = &repeatNote{first: now}
		a.repeats[id] = r
	}
	if r.told {
		a.repeatsMu.Unlock()
		return
	}
	r.n++
	unheard := r.n >= unheardRepeats && now-r.first >= a.unheardSpan
	r.told = unheard
	hint := unheard && (a.unheardHinted == 0 || now-a.unheardHinted >= hintEvery)
	if hint {
		a.unheardHinted = now
	}
	a.repeatsMu.Unlock()
	if !unheard {
		return
	}
	a.opts.Observer.ReplyUnheard()
	if hint {
		a.log.Warn("the server keeps sending again a command this bridge finished and answered: its replies do not reach the server, which reads the command sent. "+
			"The broker may take the bridge's publishes and drop them (Mosquitto does with those its ACLs refuse): "+a.grantHint(),
			"device_id", deviceID, "command_id", id, "repeats", unheardRepeats)
	}
}

// grantHint says what a bridge's MQTT account must be granted (CONTRACT
// §3, §9), for the log of a bridge whose publishes do not get through.
func (a *Agent) grantHint() string {
	p := a.tree.Prefix()
	return fmt.Sprintf("grant the bridge's account (%q) publish on %s/devices/+/replies, %s/devices/+/status, %s/devices/+/settings and %s, and read on %s/devices/+/commands/# "+
		"(acl_file, in its 'user %s' block: 'topic write %s/devices/+/replies', 'topic write %s/devices/+/status', 'topic write %s/devices/+/settings', 'topic write %s', 'topic read %s/devices/+/commands/#'; "+
		"NATS: publish and subscribe permissions on those); with the dynamic-security plugin the server grants them to a bridge it created: "+
		"run the bridge with the server's --topic-prefix (docs/mosquitto.md, section 3)",
		a.opts.Username, p, p, p, a.stateTopic, p,
		a.opts.Username, p, p, p, a.stateTopic, p)
}
