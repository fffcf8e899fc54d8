package dynsec

import (
	"slices"
	"strings"
	"time"
)

// besidesEvery is how often a client that keeps rights beside its own is
// named again (besides).
const besidesEvery = time.Hour

// besides names, at most once an hour a client and at once when what it
// holds changes, each bridge's and user's client the server made (its text
// name says so) that holds a role beside its own, or is in a group: the
// plugin grants a client what any of its roles and its groups' roles
// grant, so one role over the prefix (an operator's, made for a watcher or
// carried over from the acl_file) let a bridge read and answer every
// device's commands, another customer's included, and a user read every
// device's topics (CONTRACT §9). Reconcile makes a role of the server's
// what the store says and looked no further; nothing said so (docs/
// reliability.md, bug 497). The server takes nothing away: it cannot know
// why the operator gave it (a role to read $SYS, say); the line names
// what the client holds and the mosquitto_ctrl commands that take it away.
func (d *Driver) besides(clients []client) {
	now := time.Now()
	d.mu.Lock()
	defer d.mu.Unlock()
	seen := make(map[string]bool, len(d.wide))
	for _, c := range clients {
		var kind, own string
		switch c.TextName {
		case "companion bridge":
			kind, own = "bridge", BridgeRole(c.Username)
		case "companion user":
			kind, own = "user", UserRole(c.Username)
		default:
			continue
		}
		var roles, groups, remove []string
		for _, r := range c.Roles {
			if r.Name != own {
				roles = append(roles, r.Name)
				remove = append(remove, "mosquitto_ctrl dynsec removeClientRole "+c.Username+" "+r.Name)
			}
		}
		for _, g := range c.Groups {
			groups = append(groups, g.Name)
			remove = append(remove, "mosquitto_ctrl dynsec removeGroupClient "+g.Name+" "+c.Username)
		}
		if len(remove) == 0 {
			continue
		}
		slices.Sort(roles)
		slices.Sort(groups)
		sig := strings.Join(roles, ",") + "\x00" + strings.Join(groups, ",")
		seen[c.Username] = true
		if w, ok := d.wide[c.Username]; ok && w.sig == sig && now.Sub(w.at) < besidesEvery {
			continue
		}
		d.wide[c.Username] = widened{sig: sig, at: now}
		d.log.Warn("Mosquitto client the server made holds rights beside those the server gives: "+
			"the roles of its own and of its groups grant it more than its devices, perhaps other customers' (CONTRACT §9); "+
			"take them away unless you mean it to have them",
			"kind", kind, "username", c.Username, "own_role", own, "roles", roles, "groups", groups,
			"remove", strings.Join(remove, "; "))
	}
	for u := range d.wide {
		if !seen[u] {
			delete(d.wide, u) // taken away: named again at once should it come back
		}
	}
}

// widened is what besides last said of a client, and when.
type widened struct {
	sig string
	at  time.Time
}
