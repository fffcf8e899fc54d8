package main

import (
	"context"
	"sync"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/store"
)

// startEvents starts the hub of GET /api/v1/events on the open store and
// has it woken when events are committed: by the bbolt store after each
// such commit, or by PostgreSQL's NOTIFY from any replica (on a
// connection of its own). Close stops it, and with it every stream,
// before the HTTP server shuts down.
func (m *Main) startEvents() error {
	opts := m.Config.Events
	opts.Store = m.DB
	opts.Logger = m.storeLogger()
	hub, err := api.NewEvents(opts)
	if err != nil {
		return err
	}
	m.Events = hub
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(context.Background())
	switch {
	case m.pg != nil:
		pg := m.pg
		wg.Go(func() {
			if err := pg.ListenEvents(ctx, hub.Wake); err != nil && ctx.Err() == nil {
				m.Logger.Error("listening for events ended", "err", err)
			}
		})
	default:
		if db, ok := m.DB.(*store.DB); ok {
			db.OnEvents(hub.Wake)
		}
	}
	m.stopEvents = func() {
		cancel()
		wg.Wait()
		hub.Close()
	}
	return nil
}
