package embedded

// HoldLogins has every login the broker accepts call hold first, before
// it notes a bridge back (bridgeBack). Call it before Start.
func HoldLogins(s *Server, hold func()) {
	next := s.auth.connected
	s.auth.connected = func(id Identity) {
		hold()
		next(id)
	}
}

// Admitted is how many clients the login check knows of (ids), how many
// it let in whose session is not established yet (checked), and how many
// changes of credentials it keeps (changed).
func Admitted(s *Server) (ids, checked, changed int) {
	s.auth.mu.Lock()
	defer s.auth.mu.Unlock()
	return len(s.auth.ids), len(s.auth.checked), len(s.auth.changed)
}

// HasClient says whether mochi holds a client (a connection or a
// session) under the client id.
func HasClient(s *Server, clientID string) bool {
	_, ok := s.mochi.Clients.Get(clientID)
	return ok
}

// OnConnectionEnded has f called each time mochi is done with a
// connection: its Will, if it was to be published, has been.
func OnConnectionEnded(f func()) (undo func()) {
	testHookEnded.Store(&f)
	return func() { testHookEnded.Store(nil) }
}

// Wills is how many connections the Will hook knows of, those it would
// forget by now swept first.
func Wills(s *Server) int {
	s.will.mu.Lock()
	defer s.will.mu.Unlock()
	s.will.sweepLocked()
	return len(s.will.wills)
}
