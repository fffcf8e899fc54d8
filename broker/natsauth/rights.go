package natsauth

import (
	"context"
	"fmt"
	"sort"

	"github.com/devicecompanion/companion/broker/embedded"
)

// rights are the NATS subjects one MQTT client may publish and subscribe
// to.
type rights struct {
	pub, sub []string
}

// add appends the subjects of MQTT topics or filters to list, without
// repeats.
func add(list []string, seen map[string]bool, filters ...string) ([]string, error) {
	for _, f := range filters {
		ss, err := Subjects(f)
		if err != nil {
			return nil, err
		}
		for _, s := range ss {
			if !seen[s] {
				seen[s] = true
				list = append(list, s)
			}
		}
	}
	return list, nil
}

// rightsOf returns what id may do (CONTRACT §3, §9), from the store:
//   - the server: publish and subscribe to everything under the prefix;
//   - a bridge: subscribe to the commands of the devices it serves,
//     publish their replies, status and settings, and its own state (its
//     Will too);
//   - a user: subscribe to the topics of the devices bound to them, and
//     publish nothing.
func (r *Responder) rightsOf(ctx context.Context, id embedded.Identity) (rights, error) {
	var (
		rt       rights
		err      error
		pub, sub = map[string]bool{}, map[string]bool{}
	)
	switch id.Role {
	case embedded.RoleServer:
		all := r.opts.Topics.Prefix() + "/#"
		if rt.pub, err = add(rt.pub, pub, all); err != nil {
			return rights{}, err
		}
		rt.sub, err = add(rt.sub, sub, all)
		return rt, err
	case embedded.RoleBridge:
		state, err := r.opts.Topics.BridgeState(id.ID)
		if err != nil {
			return rights{}, err
		}
		if rt.pub, err = add(rt.pub, pub, state); err != nil {
			return rights{}, err
		}
		served, err := r.opts.Store.ServedDevices(ctx, id.ID)
		if err != nil {
			return rights{}, err
		}
		sort.Strings(served)
		for _, dev := range served {
			cmds, err1 := r.opts.Topics.CommandsGrant(dev)
			replies, err2 := r.opts.Topics.Replies(dev)
			status, err3 := r.opts.Topics.Status(dev)
			settings, err4 := r.opts.Topics.Settings(dev)
			for _, e := range []error{err1, err2, err3, err4} {
				if e != nil {
					return rights{}, e
				}
			}
			if rt.sub, err = add(rt.sub, sub, cmds); err != nil {
				return rights{}, err
			}
			if rt.pub, err = add(rt.pub, pub, replies, status, settings); err != nil {
				return rights{}, err
			}
		}
		return rt, nil
	case embedded.RoleUser:
		bs, err := r.opts.Store.ListBindings(ctx, id.ID, "", 0)
		if err != nil {
			return rights{}, err
		}
		for _, b := range bs {
			f, err := r.opts.Topics.DeviceFilter(b.DeviceID)
			if err != nil {
				return rights{}, err
			}
			if rt.sub, err = add(rt.sub, sub, f); err != nil {
				return rights{}, err
			}
		}
		return rt, nil
	}
	return rights{}, fmt.Errorf("natsauth: no rights for role %v", id.Role)
}
