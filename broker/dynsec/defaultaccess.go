package dynsec

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
)

// check asks the plugin, between the connects that Reconcile, for its
// default ACL access and its clients. The server sets the default access
// to deny as it connects (DenyByDefault) and names the clients it made
// that hold more than their own role (besides), but the plugin's
// configuration can be changed by hand at any time: an operator who set
// the default subscribe or publishClientReceive access to allow (as the
// plugin's documentation shows, to get a client of theirs going) let
// every bridge subscribe to, and receive, every device's commands, another
// customer's included, and every user every device's topics (CONTRACT §9),
// until the server's next connect, days later perhaps; and nothing said
// so (docs/reliability.md, bug 498). An access found other than
// DenyByDefault's is set back to deny and said, with what was allowed; a
// plugin that does not answer is left to Reconcile's retry, as a change
// that fails is.
func (d *Driver) check(ctx context.Context) {
	d.change.Lock()
	defer d.change.Unlock()
	rs, err := d.Do(ctx, Command{"command": "getDefaultACLAccess"},
		Command{"command": "listClients", "verbose": true, "count": -1, "offset": 0})
	if err != nil {
		if !errors.Is(err, ErrUnavailable) {
			// Unanswered, every change now fails at once until
			// Reconcile's probe has an answer: have it asked.
			d.log.Debug("checking the plugin's default ACL access", "err", err)
			signal(d.kick)
		}
		return
	}
	var access struct {
		ACLs []struct {
			Type  string `json:"acltype"`
			Allow bool   `json:"allow"`
		} `json:"acls"`
	}
	if rs[0].Err() == nil && json.Unmarshal(rs[0].Data, &access) == nil {
		want := map[string]bool{PublishClientSend: false, PublishClientReceive: false, "subscribe": false, "unsubscribe": true}
		var allowed []string
		differs := false
		for _, a := range access.ACLs {
			if w, ok := want[a.Type]; ok && w != a.Allow {
				differs = true
				if a.Allow {
					allowed = append(allowed, a.Type)
				}
			}
		}
		slices.Sort(allowed)
		if differs {
			set, err := d.Do(ctx, DenyByDefault())
			if err == nil {
				err = set[0].Err()
			}
			if err != nil {
				d.log.Error("setting the plugin's default ACL access back to deny failed; trying again at the next check", "allowed", allowed, "err", err)
			} else if len(allowed) > 0 {
				d.log.Warn("the dynamic-security plugin's default ACL access had been changed by hand to allow what no role grants: "+
					"every bridge could read every device's commands, another customer's included, and every user read every device's topics (CONTRACT §9); "+
					"set back to deny. Grant a client of your own what it needs in a role of its own instead (docs/mosquitto.md)",
					"allowed", allowed)
			}
		}
	}
	var clients struct {
		Clients []client `json:"clients"`
	}
	if rs[1].Err() == nil && json.Unmarshal(rs[1].Data, &clients) == nil {
		d.besides(clients.Clients)
	}
}
